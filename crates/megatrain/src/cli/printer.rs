//! Showing a reply as it is generated: the text of the ids so far, up to
//! its last whitespace (a word's later tokens, or a character's later
//! bytes, can change how its end decodes), the rest once the reply ends.

use std::io::Write;

use megatrain::run::Encoder;

pub struct Printer<'a, W: Write> {
    enc: &'a Encoder,
    out: W,
    /// The reply's text already shown.
    shown: String,
    /// The first error writing out, reported at the end.
    failed: Option<std::io::Error>,
}

impl<'a, W: Write> Printer<'a, W> {
    /// Shows `head` (the text before the reply: the prompt to continue, or
    /// nothing) at once.
    pub fn new(enc: &'a Encoder, out: W, head: &str) -> Self {
        let mut p = Printer {
            enc,
            out,
            shown: String::new(),
            failed: None,
        };
        p.put(head);
        p
    }

    /// The reply so far is `ids`.
    pub fn update(&mut self, ids: &[u32]) {
        let Ok(text) = self.enc.tokenizer.decode(ids) else {
            return;
        };
        let stable = text
            .char_indices()
            .rfind(|(_, c)| c.is_whitespace())
            .map_or(0, |(i, c)| i + c.len_utf8());
        if stable > self.shown.len() && text.starts_with(&self.shown) {
            let new = &text[self.shown.len()..stable];
            self.shown.push_str(new);
            let new = new.to_string();
            self.put(&new);
        }
    }

    /// The whole reply is `reply`: shows what is not shown yet and ends
    /// the line. Where a later token changed text already shown (no
    /// tokenizer we know of does at a whitespace), the whole reply follows
    /// on a line of its own.
    pub fn finish(mut self, reply: &str) -> anyhow::Result<()> {
        match reply.strip_prefix(self.shown.as_str()) {
            Some(rest) => self.put(&format!("{rest}\n")),
            None => self.put(&format!("\n{reply}\n")),
        }
        match self.failed {
            Some(e) => Err(anyhow::anyhow!("standard output: {e}")),
            None => Ok(()),
        }
    }

    fn put(&mut self, text: &str) {
        if let Err(e) = self
            .out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
        {
            self.failed.get_or_insert(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte by byte, a reply with characters of two and three bytes comes
    /// out whole words at a time, and in the end exactly as decoded.
    #[test]
    fn words_show_whole_and_the_end_completes_the_reply() {
        let enc = Encoder::choose("byte", None, None, &[]).unwrap();
        let reply = "héllo wörld — ünïcode\nnext";
        let ids = enc.tokenizer.encode(reply).unwrap();
        let mut out = Vec::new();
        let mut p = Printer::new(&enc, &mut out, "O Romeo");
        let mut seen = Vec::new();
        for n in 1..=ids.len() {
            p.update(&ids[..n]);
            seen.push(String::from_utf8(p.out.to_vec()).expect("whole characters only"));
        }
        assert!(seen.contains(&"O Romeohéllo ".to_string()), "{seen:?}");
        assert!(seen.contains(&"O Romeohéllo wörld — ünïcode\n".to_string()));
        assert!(!seen.iter().any(|s| s.ends_with("wö")), "no word before its end");
        p.finish(reply).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), format!("O Romeo{reply}\n"));
    }
}
