//! Instruction data: alpaca (`instruction`, `input`, `output`) and sharegpt
//! (`conversations: [{from, value}]`) records, one JSON object per line. The
//! loss counts only response tokens (and the end-of-sequence after them).

use std::path::Path;

use rayon::prelude::*;
use serde_json::Value;

use super::{DataError, TextEncoder, TokenData};

/// The text placed around prompts and responses. The default is the
/// Stanford Alpaca prompt; sharegpt turns use the same headers by role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    pub system: String,
    pub user: String,
    pub user_with_input: String,
    pub assistant: String,
}

impl Default for ChatTemplate {
    fn default() -> Self {
        ChatTemplate {
            system: "{text}\n\n".into(),
            user: "### Instruction:\n{text}\n\n".into(),
            user_with_input: "### Instruction:\n{text}\n\n### Input:\n{input}\n\n".into(),
            assistant: "### Response:\n".into(),
        }
    }
}

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
    let (mut tokens, mut mask) = (Vec::new(), Vec::new());
    for batch in lines.chunks(RECORDS_PER_BATCH) {
        let records: Vec<Result<Builder, DataError>> = batch
            .par_iter()
            .map(|&(line, text)| record(path, line, text, enc, t))
            .collect();
        // In line order, so the first bad line is the one named.
        for r in records {
            let b = r?;
            tokens.extend(b.tokens);
            mask.extend(b.mask);
        }
    }
    Ok(TokenData {
        tokens: tokens.into(),
        loss_mask: Some(mask.into()),
    })
}

/// The tokens and mask of the record on line `line`.
fn record<'a>(
    path: &'a Path,
    line: usize,
    text: &str,
    enc: &'a dyn TextEncoder,
    t: &ChatTemplate,
) -> Result<Builder<'a>, DataError> {
    let mut b = Builder {
        path,
        line,
        enc,
        tokens: Vec::new(),
        mask: Vec::new(),
    };
    let rec: Value = serde_json::from_str(text).map_err(|e| b.err(format!("invalid JSON: {e}")))?;
    if rec.get("conversations").is_some() {
        sharegpt(&mut b, &rec, t)?;
    } else if rec.get("instruction").is_some() {
        alpaca(&mut b, &rec, t)?;
    } else {
        return Err(b.err("record has neither 'instruction' (alpaca) nor 'conversations' (sharegpt)"));
    }
    Ok(b)
}

fn alpaca(b: &mut Builder, rec: &Value, t: &ChatTemplate) -> Result<(), DataError> {
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

fn sharegpt(b: &mut Builder, rec: &Value, t: &ChatTemplate) -> Result<(), DataError> {
    let Some(turns) = rec["conversations"].as_array() else {
        return Err(b.err("'conversations' must be an array"));
    };
    if turns.is_empty() {
        return Err(b.err("'conversations' is empty"));
    }
    for (k, turn) in turns.iter().enumerate() {
        let from = field(turn, "from").map_err(|d| b.err(format!("conversations[{k}]: {d}")))?;
        let value = field(turn, "value").map_err(|d| b.err(format!("conversations[{k}]: {d}")))?;
        match from {
            "system" => b.push(&t.system.replace("{text}", value), false)?,
            "human" | "user" => b.push(&t.user.replace("{text}", value), false)?,
            "gpt" | "assistant" => {
                b.push(&t.assistant, false)?;
                b.push(value, true)?;
                b.push_eos();
            }
            other => {
                return Err(b.err(format!(
                    "conversations[{k}]: unknown role '{other}' (expected system, human, user, gpt or assistant)"
                )));
            }
        }
    }
    Ok(())
}
