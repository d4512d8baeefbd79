//! Records, one JSON object per line: instruction data, alpaca
//! (`instruction`, `input`, `output`), sharegpt (`conversations: [{from,
//! value}]`) and chat (`messages: [{role, content}]`), whose loss counts
//! only response tokens (and what ends them: the end-of-sequence id after
//! headers, a template's own end-of-turn tokens); and documents (`text`,
//! as Hugging Face datasets and pretraining corpora store them), every
//! token counted, each followed by the end-of-sequence id where the
//! tokenizer has one.

use std::path::Path;

use rayon::prelude::*;
use serde_json::Value;

use super::chat::{ChatTemplate, Headers, Message, Piece, Renderer};
use super::{DataError, Records, TextEncoder, TokenData};

struct Builder<'a> {
    path: &'a Path,
    line: usize,
    enc: &'a dyn TextEncoder,
    tokens: Vec<u32>,
    mask: Vec<bool>,
}

impl Builder<'_> {
    fn push(&mut self, text: &str, counted: bool) -> Result<(), DataError> {
        let ids = self
            .enc
            .encode(text)
            .map_err(|detail| self.err(format!("tokenizer: {detail}")))?;
        self.mask.extend(std::iter::repeat_n(counted, ids.len()));
        self.tokens.extend(ids);
        Ok(())
    }

    /// A rendered conversation, encoded whole as the model will see it
    /// where the tokenizer gives offsets (a token is counted where it
    /// starts in a counted piece), else piece by piece.
    fn push_rendered(&mut self, pieces: &[Piece]) -> Result<(), DataError> {
        let text: String = pieces.iter().map(|p| p.0.as_str()).collect();
        let Some(encoded) = self.enc.encode_with_offsets(&text) else {
            for (piece, counted) in pieces {
                self.push(piece, *counted)?;
            }
            return Ok(());
        };
        let (ids, starts) = encoded.map_err(|detail| self.err(format!("tokenizer: {detail}")))?;
        // (end byte, counted) of each piece, in order.
        let mut ends = Vec::with_capacity(pieces.len());
        let mut end = 0;
        for (piece, counted) in pieces {
            end += piece.len();
            ends.push((end, *counted));
        }
        let counted = starts
            .iter()
            .map(|&s| ends.iter().find(|e| s < e.0).is_some_and(|e| e.1));
        self.mask.extend(counted);
        self.tokens.extend(ids);
        Ok(())
    }

    fn push_eos(&mut self) {
        if let Some(eos) = self.enc.eos() {
            self.tokens.push(eos);
            self.mask.push(true);
        }
    }

    fn err(&self, detail: impl Into<String>) -> DataError {
        DataError::Jsonl {
            path: self.path.to_path_buf(),
            line: self.line,
            detail: detail.into(),
        }
    }
}

fn field<'v>(obj: &'v Value, key: &str) -> Result<&'v str, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!("field '{key}' must be a string, found {other}")),
        None => Err(format!("missing field '{key}'")),
    }
}

/// Records tokenized together, on every core, before they are appended
/// in order: bounds what is held beside the stream to a batch of them.
const RECORDS_PER_BATCH: usize = 4096;

pub(super) fn load_jsonl(
    path: &Path,
    enc: &dyn TextEncoder,
    t: &ChatTemplate,
) -> Result<TokenData, DataError> {
    let text = std::fs::read_to_string(path).map_err(super::io(path))?;
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l))
        .collect();
    let form = match t {
        ChatTemplate::Headers(h) => Form::Headers(h),
        ChatTemplate::Jinja(j) => Form::Jinja(Box::new(Renderer::new(j).map_err(DataError::Template)?)),
    };
    let (mut tokens, mut mask, mut starts) = (Vec::new(), Vec::new(), Vec::new());
    for batch in lines.chunks(RECORDS_PER_BATCH) {
        let records: Vec<Result<Builder, DataError>> = batch
            .par_iter()
            .map(|&(line, text)| record(path, line, text, enc, &form))
            .collect();
        // In line order, so the first bad line is the one named.
        for r in records {
            let b = r?;
            if !b.tokens.is_empty() {
                starts.push(tokens.len());
            }
            tokens.extend(b.tokens);
            mask.extend(b.mask);
        }
    }
    Ok(TokenData {
        tokens: tokens.into(),
        loss_mask: Some(mask.into()),
        records: Some(Records::new(starts)),
    })
}

/// How records become text: headers, or a compiled template.
enum Form<'a> {
    Headers(&'a Headers),
    Jinja(Box<Renderer>),
}

/// The tokens and mask of the record on line `line`.
fn record<'a>(
    path: &'a Path,
    line: usize,
    text: &str,
    enc: &'a dyn TextEncoder,
    form: &Form,
) -> Result<Builder<'a>, DataError> {
    let mut b = Builder {
        path,
        line,
        enc,
        tokens: Vec::new(),
        mask: Vec::new(),
    };
    let rec: Value = serde_json::from_str(text).map_err(|e| b.err(format!("invalid JSON: {e}")))?;
    let conversation = ["instruction", "conversations", "messages"]
        .iter()
        .any(|k| rec.get(k).is_some());
    if !conversation && rec.get("text").is_some() {
        let doc = field(&rec, "text").map_err(|d| b.err(d))?;
        b.push(doc, true)?;
        b.push_eos();
        return Ok(b);
    }
    match form {
        Form::Headers(h) if rec.get("instruction").is_some() => alpaca_headers(&mut b, &rec, h)?,
        Form::Headers(h) => {
            let messages = messages(&rec).map_err(|d| b.err(d))?;
            headers(&mut b, &messages, h)?;
        }
        Form::Jinja(r) => {
            let messages = messages(&rec).map_err(|d| b.err(d))?;
            for pieces in r.renderings(&messages).map_err(|d| b.err(d))? {
                b.push_rendered(&pieces)?;
            }
        }
    }
    Ok(b)
}

/// A record's conversation: `messages` as written, `conversations` with
/// sharegpt's roles named as chat templates name them, an alpaca record
/// as a user turn (the instruction, a blank line and the input) and the
/// response.
fn messages(rec: &Value) -> Result<Vec<Message>, String> {
    let (key, turns) = match (rec.get("messages"), rec.get("conversations")) {
        (Some(m), _) => ("messages", m),
        (None, Some(c)) => ("conversations", c),
        (None, None) if rec.get("instruction").is_some() => {
            let instruction = field(rec, "instruction")?;
            let output = field(rec, "output")?;
            let user = match rec.get("input") {
                None | Some(Value::Null) => instruction.to_string(),
                Some(_) => match field(rec, "input")? {
                    "" => instruction.to_string(),
                    input => format!("{instruction}\n\n{input}"),
                },
            };
            return Ok(vec![
                Message {
                    role: "user".into(),
                    content: user,
                },
                Message {
                    role: "assistant".into(),
                    content: output.into(),
                },
            ]);
        }
        (None, None) => {
            return Err(
                "record has neither 'text' (a document), 'instruction' (alpaca), 'conversations' (sharegpt) nor 'messages' (chat)"
                    .into(),
            );
        }
    };
    let Some(turns) = turns.as_array() else {
        return Err(format!("'{key}' must be an array"));
    };
    if turns.is_empty() {
        return Err(format!("'{key}' is empty"));
    }
    turns
        .iter()
        .enumerate()
        .map(|(k, turn)| {
            let at = |d: String| format!("{key}[{k}]: {d}");
            let (role, content) = match (turn.get("role"), turn.get("from")) {
                (Some(_), _) => (
                    field(turn, "role").map_err(at)?,
                    field(turn, "content").map_err(at)?,
                ),
                (None, Some(_)) => (
                    field(turn, "from").map_err(at)?,
                    field(turn, "value").map_err(at)?,
                ),
                (None, None) => return Err(at("missing field 'role' (or sharegpt's 'from')".into())),
            };
            let role = match role {
                "human" => "user",
                "gpt" => "assistant",
                other => other,
            };
            Ok(Message {
                role: role.into(),
                content: content.into(),
            })
        })
        .collect()
}

fn alpaca_headers(b: &mut Builder, rec: &Value, t: &Headers) -> Result<(), DataError> {
    let instruction = field(rec, "instruction").map_err(|d| b.err(d))?;
    let output = field(rec, "output").map_err(|d| b.err(d))?;
    let input = match rec.get("input") {
        None | Some(Value::Null) => "",
        Some(_) => field(rec, "input").map_err(|d| b.err(d))?,
    };
    let prompt = if input.is_empty() {
        t.user.replace("{text}", instruction)
    } else {
        t.user_with_input
            .replace("{text}", instruction)
            .replace("{input}", input)
    };
    b.push(&(prompt + &t.assistant), false)?;
    b.push(output, true)?;
    b.push_eos();
    Ok(())
}

/// `messages` under headers, each reply followed by the end-of-sequence id.
fn headers(b: &mut Builder, messages: &[Message], t: &Headers) -> Result<(), DataError> {
    for (text, counted) in t.pieces(messages).map_err(|d| b.err(d))? {
        b.push(&text, counted)?;
        if counted {
            b.push_eos();
        }
    }
    Ok(())
}
