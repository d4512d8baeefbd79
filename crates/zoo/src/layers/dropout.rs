//! Dropout in a training forward, where GPT-2 and nanoGPT put it: on the
//! embedding's output, on each residual branch's output before it joins
//! the residual stream (the attention's and the MLP's, after the norms a
//! family puts there), and on the attention's probabilities. Each site of
//! each layer draws its own mask from the step's key
//! ([`megatrain_tensor::Dropout`]: a hash, so a recomputed forward and the
//! backward draw the same one and nothing is stored); evaluation and
//! generation pass none. NEFTune's uniform noise on the embedding's lookup
//! is drawn the same way ([`megatrain_tensor::Noise`]).

use megatrain_tensor::{Docs, Dropout, Executor, Noise, mix64};

use crate::{Result, ZooError};

/// The dropout sites of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Site {
    /// The embedding's output (layer 0).
    Embedding = 1,
    /// The attention's probabilities.
    Attention = 2,
    /// The attention branch's output (a linear-attention block's too).
    AttnOut = 3,
    /// The MLP's output (a routed one's too).
    MlpOut = 4,
    /// NEFTune's noise on the embedding's lookup.
    Noise = 5,
}

/// A training forward's dropout: `hidden` on the embedding's and the
/// residual branches' outputs, `attention` on the probabilities, each mask
/// drawn from `key` (the trainer mixes its seed, the step and the
/// micro-batch into it) and the site, rows counted from batch row
/// `batch0` of the step's whole batch; and NEFTune's noise of `neftune`
/// α on the embedding's lookup, drawn the same way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropouts {
    hidden: f64,
    attention: f64,
    neftune: f64,
    key: u64,
    batch0: usize,
}

impl Dropouts {
    /// `None` where both probabilities are 0; a probability outside
    /// `[0, MAX_DROPOUT]` is refused by name.
    pub fn new(hidden: f64, attention: f64, key: u64) -> Result<Option<Dropouts>> {
        Self::with_noise(hidden, attention, 0.0, key)
    }

    /// [`Dropouts::new`] with NEFTune's α (Jain et al. 2023, transformers'
    /// `neftune_noise_alpha`: 5 in the paper's runs): uniform noise of
    /// magnitude α / √(T·C) added to the embedding table's lookup, before
    /// position embeddings and any scale, as transformers' hook on the
    /// input embeddings adds it. `None` where all three are 0; α negative
    /// or not finite is refused.
    pub fn with_noise(hidden: f64, attention: f64, neftune: f64, key: u64) -> Result<Option<Dropouts>> {
        for (p, what) in [(hidden, "hidden"), (attention, "attention")] {
            Dropout::new(p, key, "dropout")
                .map_err(|e| ZooError::invalid("dropout", format!("{what}: {e}")))?;
        }
        // Its magnitude is an f32 no larger than α.
        if !((neftune as f32).is_finite() && neftune >= 0.0) {
            return Err(ZooError::invalid(
                "dropout",
                format!("NEFTune's alpha must be finite and >= 0, not {neftune}"),
            ));
        }
        Ok(
            (hidden > 0.0 || attention > 0.0 || neftune > 0.0).then_some(Dropouts {
                hidden,
                attention,
                neftune,
                key,
                batch0: 0,
            }),
        )
    }

    pub fn neftune(&self) -> f64 {
        self.neftune
    }

    /// The same dropout for rows that begin at batch row `batch0` of the
    /// step's batch (a micro-batch's or a rank's share).
    pub fn at_batch_row(self, batch0: usize) -> Dropouts {
        Dropouts { batch0, ..self }
    }

    pub fn hidden(&self) -> f64 {
        self.hidden
    }

    pub fn attention(&self) -> f64 {
        self.attention
    }

    /// Site `site` of layer `layer` (table order: the embedding is 0,
    /// block i is 1 + i); `None` where its probability is 0.
    pub(crate) fn site(&self, layer: usize, site: Site) -> Option<Dropout> {
        let p = match site {
            Site::Attention => self.attention,
            Site::Noise => return None,
            _ => self.hidden,
        };
        let key = mix64(&[self.key, layer as u64, site as u64]);
        Dropout::new(p, key, "dropout")
            .expect("checked by Dropouts::new")
            .map(|d| d.at_batch_row(self.batch0))
    }
}

/// The rows a training forward (or evaluation) runs: the documents packed
/// in them where they hold several, and the forward's dropout where it has
/// one. `Option<&Docs>` converts into rows without dropout.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rows<'a> {
    pub docs: Option<&'a Docs>,
    pub dropout: Option<Dropouts>,
}

impl<'a> From<Option<&'a Docs>> for Rows<'a> {
    fn from(docs: Option<&'a Docs>) -> Rows<'a> {
        Rows { docs, dropout: None }
    }
}

impl Rows<'_> {
    /// Site `site` of layer `layer`'s dropout, if any.
    pub(crate) fn site(&self, layer: usize, site: Site) -> Option<Dropout> {
        self.dropout.and_then(|d| d.site(layer, site))
    }

    /// NEFTune's noise on the lookup of rows of `seq` tokens of `hidden`
    /// features, if any.
    pub(crate) fn embedding_noise(&self, seq: usize, hidden: usize) -> Option<Noise> {
        let d = self.dropout?;
        if d.neftune == 0.0 || seq * hidden == 0 {
            return None;
        }
        let magnitude = d.neftune / ((seq * hidden) as f64).sqrt();
        let key = mix64(&[d.key, 0, Site::Noise as u64]);
        Noise::new(magnitude, key, "neftune")
            .expect("alpha checked by Dropouts::with_noise")
            .map(|n| n.at_batch_row(d.batch0))
    }
}

/// The dropouts of a block's two residual branches, which its forward
/// applies and saves for its backward.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Branches {
    pub attn: Option<Dropout>,
    pub mlp: Option<Dropout>,
}

/// `x` through `d` where there is one.
pub(crate) fn dropout_branch<E: Executor>(ex: &E, x: E::Tensor, d: Option<Dropout>) -> Result<E::Tensor> {
    Ok(dropped(ex, d, &x)?.unwrap_or(x))
}

/// `x` through `d` where there is one, else `None` (`x` itself): a
/// branch's output the forward keeps, or in the backward the gradient of a
/// [`dropout_branch`]'s input from its output's (dropout is its own
/// adjoint).
pub(crate) fn dropped<E: Executor>(ex: &E, d: Option<Dropout>, x: &E::Tensor) -> Result<Option<E::Tensor>> {
    Ok(d.map(|d| ex.dropout(x, &d)).transpose()?)
}
