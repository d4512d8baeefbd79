//! The loss curve, `loss.svg`: training loss per step and validation loss
//! at each evaluation, drawn with `plotters`' SVG backend.

use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

use super::error::{Result, RunError};

pub const PLOT_FILE: &str = "loss.svg";

fn series(records: &[Value], key: &str) -> Vec<(f64, f64)> {
    records
        .iter()
        .filter_map(|r| {
            let s = r.get("step")?.as_u64()? as f64;
            let y = r.get(key)?.as_f64()?;
            y.is_finite().then_some((s, y))
        })
        .collect()
}

/// Renders the curves to an SVG string.
pub fn render_svg(records: &[Value]) -> Result<String> {
    let train = series(records, "loss");
    let val = series(records, "val_loss");
    let all = train.iter().chain(&val);
    let (mut x1, mut y0, mut y1) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in all {
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let mut svg = String::new();
    {
        let draw_err = |e: &dyn std::fmt::Display| RunError::Config(format!("plot: {e}"));
        let root = SVGBackend::with_string(&mut svg, (800, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw_err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("loss", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(52)
            .build_cartesian_2d(0f64..x1, (y0 - pad)..(y1 + pad))
            .map_err(|e| draw_err(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .draw()
            .map_err(|e| draw_err(&e))?;
        chart
            .draw_series(LineSeries::new(train, &BLUE))
            .map_err(|e| draw_err(&e))?
            .label("train")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
        chart
            .draw_series(LineSeries::new(val.clone(), RED.stroke_width(2)))
            .map_err(|e| draw_err(&e))?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
        chart
            .draw_series(val.iter().map(|&p| Circle::new(p, 3, RED.filled())))
            .map_err(|e| draw_err(&e))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| draw_err(&e))?;
        root.present().map_err(|e| draw_err(&e))?;
    }
    Ok(svg)
}

/// Replaces `run/loss.svg` atomically.
pub fn write_plot(run: &Path, records: &[Value]) -> Result<()> {
    let svg = render_svg(records)?;
    megatrain_tier::atomic::write_atomic(&run.join(PLOT_FILE), svg.as_bytes())?;
    Ok(())
}
