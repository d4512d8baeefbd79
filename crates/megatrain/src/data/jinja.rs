//! The Jinja environment transformers renders chat templates in
//! (`transformers.utils.chat_template_utils`): blocks trimmed and
//! left-stripped, loop controls, `raise_exception`, `strftime_now`, a
//! `tojson` that writes what Python's `json.dumps` writes (no HTML
//! escaping), and Python's string and dict methods (`.strip()`,
//! `.startswith()`, `.items()`, ...).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// An environment holding `source` as the template `chat`.
pub(super) fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters");
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| strftime_utc(&fmt, now_unix()));
    env.add_filter("tojson", tojson);
    env.add_template_owned("chat", source)?;
    Ok(env)
}

/// `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=...)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(&value, indent, sort.unwrap_or(false), 0, &mut out)?;
    Ok(out)
}

fn dump(v: &Value, indent: Option<usize>, sort: bool, level: usize, out: &mut String) -> Result<(), Error> {
    let quote = |s: &str| serde_json::to_string(s).expect("a string serializes");
    // Python puts ", " between items on one line and "," before a newline.
    let open = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => out.push_str(&quote(v.as_str().unwrap_or_default())),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                open(out, level + 1);
                out.push_str(&quote(&k.to_string()));
                out.push_str(": ");
                dump(&v.get_item(k)?, indent, sort, level + 1, out)?;
            }
            open(out, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                open(out, level + 1);
                dump(item, indent, sort, level + 1, out)?;
            }
            open(out, level);
            out.push(']');
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {other} is not JSON"),
            ));
        }
    }
    Ok(())
}

fn now_unix() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| d.as_secs() as i64)
}

/// `strftime` of the UTC time `unix` (seconds), for the specifiers chat
/// templates use (`%d %b %Y`, `%Y-%m-%d`, `%B`, `%H:%M`, ...); others are
/// kept as written.
pub fn strftime_utc(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Day 0, 1970-01-01, was a Thursday.
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // The civil date of a day count (Howard Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let month_name = MONTHS[(month - 1) as usize];
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let day_of_year = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(month - 1) as usize]
        + day
        + i64::from(leap && month > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:>2}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('b') => out += &month_name[..3],
            Some('B') => out += month_name,
            Some('a') => out += &weekday[..3],
            Some('A') => out += weekday,
            Some('H') => out += &format!("{:02}", secs / 3600),
            Some('M') => out += &format!("{:02}", secs / 60 % 60),
            Some('S') => out += &format!("{:02}", secs % 60),
            Some('j') => out += &format!("{day_of_year:03}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_gives_the_civil_date() {
        // 2024-07-26 00:00:00 UTC, a Friday; 2000-02-29 12:34:56, a Tuesday.
        assert_eq!(strftime_utc("%d %b %Y", 1_721_952_000), "26 Jul 2024");
        assert_eq!(
            strftime_utc("%A %B %e, %y %j", 1_721_952_000),
            "Friday July 26, 24 208"
        );
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %a %%%q", 951_827_696),
            "2000-02-29 12:34:56 Tue %%q"
        );
        assert_eq!(strftime_utc("%d/%m/%Y", 0), "01/01/1970");
    }

    fn render(source: &str) -> String {
        let env = environment(source.into()).unwrap();
        env.get_template("chat").unwrap().render(()).unwrap()
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        assert_eq!(
            render("{{ {'a': 'b<c>&\\'é', 'n': [1, 2.5, none, true]} | tojson }}"),
            r#"{"a": "b<c>&'é", "n": [1, 2.5, null, true]}"#
        );
        assert_eq!(
            render("{{ {'b': [], 'a': {'x': 1}} | tojson(indent=2, sort_keys=true) }}"),
            "{\n  \"a\": {\n    \"x\": 1\n  },\n  \"b\": []\n}"
        );
    }

    #[test]
    fn python_methods_and_loop_controls_work() {
        assert_eq!(
            render(
                "{{ ' x '.strip() }}{{ 'a,b'.split(',') | join('+') }}{% if 'abc'.startswith('ab') %}Y{% endif %}\
                 {% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
            ),
            "xa+bY012"
        );
    }
}
