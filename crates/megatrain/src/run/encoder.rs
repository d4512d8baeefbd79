//! The zoo's tokenizers as the data layer's [`TextEncoder`], with the
//! end-of-sequence id, how they are chosen, and how they travel with a
//! checkpoint.

use std::path::{Path, PathBuf};

use megatrain_zoo::{CHAR_VOCAB_FILE, CharTokenizer, HF_TOKENIZER_FILE, ModelConfig, Tokenizer};
use serde_json::Value;

use super::error::{Result, RunError};
use crate::data::{ChatTemplate, DataError, Fnv1a, Headers, JinjaTemplate, Offsets, TextEncoder};

/// Files beside an HF `tokenizer.json` that travel with it into
/// checkpoints: what HF loaders read beside it, the chat template, and
/// `generation_config.json` (a chat model's end-of-turn ids).
const HF_SIDE_FILES: &[&str] = &[
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    "generation_config.json",
];

/// An HF tokenizer's settings: special token strings, the chat template.
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// Where transformers 4.43 and later save a tokenizer's chat template.
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// Special tokens that end a sequence in the common HF vocabularies.
const EOS_NAMES: &[&str] = &["</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>"];

/// A tokenizer, its end-of-sequence id and where its files came from.
#[derive(Debug)]
pub struct Encoder {
    pub tokenizer: Tokenizer,
    pub eos: Option<u32>,
    /// The HF directory or file the tokenizer was read from.
    source: Option<PathBuf>,
    /// Token ids the data may hold: the model's vocabulary once it is known
    /// (a token file needs no tokenizer, only ids below it).
    pub vocab_limit: Option<usize>,
}

impl TextEncoder for Encoder {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.tokenizer.encode(text).map_err(|e| e.to_string())
    }

    fn encode_with_offsets(&self, text: &str) -> Option<std::result::Result<Offsets, String>> {
        Some(
            self.tokenizer
                .encode_with_offsets(text)
                .map_err(|e| e.to_string()),
        )
    }

    fn eos(&self) -> Option<u32> {
        self.eos
    }

    fn vocab_size(&self) -> usize {
        self.vocab_limit.unwrap_or_else(|| self.tokenizer.vocab_size())
    }

    /// The tokenizer's kind and contents: an HF file's bytes (hashed), a
    /// char vocabulary's characters.
    fn cache_key(&self) -> Option<String> {
        match &self.tokenizer {
            Tokenizer::Hf { path, .. } => {
                let bytes = std::fs::read(path).ok()?;
                let mut h = Fnv1a::default();
                h.bytes(&bytes);
                Some(format!("hf {} {:016x}", bytes.len(), h.finish()))
            }
            Tokenizer::Char(c) => Some(format!("char {}", c.chars().iter().collect::<String>())),
            Tokenizer::Byte => Some("byte".into()),
        }
    }
}

/// The kind name recorded in a run's state (`hf`, `char`, `byte`).
pub fn kind_name(t: &Tokenizer) -> &'static str {
    match t {
        Tokenizer::Hf { .. } => "hf",
        Tokenizer::Char(_) => "char",
        Tokenizer::Byte => "byte",
    }
}

fn eos_of(tok: &Tokenizer, model: Option<&ModelConfig>) -> Option<u32> {
    let Tokenizer::Hf { inner, .. } = tok else {
        return None;
    };
    let vocab = tok.vocab_size() as u64;
    let from_config = model
        .and_then(|m| m.raw.as_ref())
        .and_then(|raw| match raw.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64(),
            Some(Value::Array(a)) => a.first().and_then(Value::as_u64),
            _ => None,
        })
        .filter(|&id| id < vocab)
        .map(|id| id as u32);
    from_config.or_else(|| EOS_NAMES.iter().find_map(|n| inner.token_to_id(n)))
}

impl Encoder {
    pub fn new(tokenizer: Tokenizer, model: Option<&ModelConfig>, source: Option<PathBuf>) -> Self {
        let eos = eos_of(&tokenizer, model);
        Encoder {
            tokenizer,
            eos,
            source,
            vocab_limit: None,
        }
    }

    pub fn kind(&self) -> &'static str {
        kind_name(&self.tokenizer)
    }

    /// Chooses the tokenizer of a training run. `spec` is `auto`, `char`,
    /// `byte` or a path to a `tokenizer.json`; `char` builds its vocabulary
    /// from the characters of `corpora`.
    pub fn choose(
        spec: &str,
        model_dir: Option<&Path>,
        preset: Option<&str>,
        corpora: &[&Path],
    ) -> Result<Encoder> {
        let model_cfg = match model_dir {
            Some(d) => Some(ModelConfig::from_dir(d)?),
            None => None,
        };
        match spec {
            "byte" => Ok(Encoder::new(Tokenizer::Byte, None, None)),
            "char" => Ok(Encoder::new(Tokenizer::Char(char_vocab(corpora)?), None, None)),
            "auto" => {
                if let Some(dir) = model_dir {
                    let file = dir.join(HF_TOKENIZER_FILE);
                    if file.exists() {
                        let tok = Tokenizer::from_hf_file(&file)?;
                        return Ok(Encoder::new(tok, model_cfg.as_ref(), Some(file)));
                    }
                    let token_data = corpora.iter().all(|p| crate::data::is_token_file(p));
                    return match Tokenizer::from_dir(dir)? {
                        Some(tok) => Ok(Encoder::new(tok, model_cfg.as_ref(), None)),
                        // Token ids need no tokenizer to train; bytes decode samples.
                        None if token_data => Ok(Encoder::new(Tokenizer::Byte, None, None)),
                        None => Err(RunError::file(
                            dir,
                            "has no tokenizer.json or char_vocab.json; pass --tokenizer char|byte|<file>",
                        )),
                    };
                }
                let token_data = corpora.iter().any(|p| crate::data::is_token_file(p));
                if preset == Some("gpt2-nano") && !token_data {
                    Encoder::choose("char", None, preset, corpora)
                } else {
                    Encoder::choose("byte", None, preset, corpora)
                }
            }
            path => {
                let file = PathBuf::from(path);
                let file = if file.is_dir() {
                    file.join(HF_TOKENIZER_FILE)
                } else {
                    file
                };
                let tok = Tokenizer::from_hf_file(&file)?;
                Ok(Encoder::new(tok, model_cfg.as_ref(), Some(file)))
            }
        }
    }

    /// The tokenizer saved in a checkpoint or HF directory (`tokenizer.json`,
    /// else `char_vocab.json`); byte-level when `kind` says so or there is
    /// neither.
    pub fn from_dir(dir: &Path, model: Option<&ModelConfig>) -> Result<Encoder> {
        match Tokenizer::from_dir(dir)? {
            Some(tok) => {
                let src = dir.join(HF_TOKENIZER_FILE);
                let source = src.exists().then_some(src);
                Ok(Encoder::new(tok, model, source))
            }
            None => Ok(Encoder::new(Tokenizer::Byte, None, None)),
        }
    }

    /// Writes the tokenizer's files into `dir` (nothing for byte-level).
    pub fn save_to(&self, dir: &Path) -> Result<()> {
        match &self.tokenizer {
            Tokenizer::Char(c) => c.save(dir.join(CHAR_VOCAB_FILE))?,
            Tokenizer::Byte => {}
            Tokenizer::Hf { path, .. } => {
                let src_dir = path.parent().unwrap_or(Path::new("."));
                copy_atomic(path, &dir.join(HF_TOKENIZER_FILE))?;
                for side in HF_SIDE_FILES {
                    let p = src_dir.join(side);
                    if p.exists() {
                        copy_atomic(&p, &dir.join(side))?;
                    }
                }
            }
        }
        Ok(())
    }

    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// The template `.jsonl` records are rendered with. `spec` is `auto`
    /// (the template shipped beside the tokenizer: `chat_template.jinja`,
    /// else `chat_template` in `tokenizer_config.json`; the Alpaca headers
    /// where there is none), `alpaca`, or a path: a Jinja file or a
    /// `tokenizer_config.json`. A template's `bos_token` and `eos_token`
    /// are the tokenizer's, from its `tokenizer_config.json`.
    pub fn chat_template(&self, spec: &str) -> Result<ChatTemplate> {
        let side = self.source.as_deref().and_then(Path::parent);
        let side = match (spec, side) {
            ("alpaca", _) | ("auto", None) => return Ok(ChatTemplate::default()),
            (_, side) => side,
        };
        // The tokenizer's settings, read once: its token strings, and
        // under `auto` its template.
        let config_path = side.map(|d| d.join(TOKENIZER_CONFIG)).filter(|p| p.is_file());
        let config = config_path.as_deref().map(read_json).transpose()?;
        let (source, origin) = match (spec, side) {
            ("auto", Some(dir)) => {
                let file = dir.join(CHAT_TEMPLATE_FILE);
                let in_config = match (&config_path, &config) {
                    (Some(p), Some(v)) => template_in(v, p)?.map(|t| (t, p.clone())),
                    _ => None,
                };
                match (file.is_file(), in_config) {
                    (true, _) => (read_text(&file)?, file),
                    (false, Some(found)) => found,
                    (false, None) => return Ok(ChatTemplate::default()),
                }
            }
            (path, _) => {
                let file = PathBuf::from(path);
                let source = match file.extension().is_some_and(|e| e == "json") {
                    true => template_in(&read_json(&file)?, &file)?.ok_or_else(|| {
                        RunError::option("chat-template", path, "the file has no chat_template")
                    })?,
                    false => read_text(&file)?,
                };
                (source, file)
            }
        };
        if matches!(self.tokenizer, Tokenizer::Char(_)) {
            return Err(RunError::option(
                "chat-template",
                spec,
                "a char vocabulary is built from the data and the Alpaca headers, not from what a \
                 template writes; use --chat-template alpaca or a Hugging Face tokenizer",
            ));
        }
        let token = |key: &str| match config.as_ref().and_then(|c| c.get(key)) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or("").to_string(),
            _ => String::new(),
        };
        Ok(ChatTemplate::Jinja(JinjaTemplate {
            source,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            origin,
        }))
    }
}

impl Encoder {
    /// The ids that end a chat model's reply: the end-of-sequence ids of
    /// the model's `config.json` and of `generation_config.json` in `dir`
    /// (each a number or a list: Llama 3's instruct models list their
    /// end-of-turn id there), and the tokenizer's own.
    pub fn stop_ids(&self, model: &ModelConfig, dir: &Path) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = self.eos.into_iter().collect();
        let generation = dir.join("generation_config.json");
        let generation = generation.is_file().then(|| read_json(&generation)).transpose()?;
        for v in [model.raw.as_ref(), generation.as_ref()].into_iter().flatten() {
            match v.get("eos_token_id") {
                Some(Value::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
                Some(Value::Array(a)) => ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32)),
                _ => {}
            }
        }
        ids.retain(|&i| (i as usize) < model.vocab_size);
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(RunError::io(path))
}

fn read_json(path: &Path) -> Result<Value> {
    serde_json::from_str(&read_text(path)?).map_err(|e| RunError::file(path, e.to_string()))
}

/// The `chat_template` of a `tokenizer_config.json` (`config`, read from
/// `path`): a string, or of a list of named templates the one named
/// `default`.
fn template_in(config: &Value, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let default = list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
            match default.and_then(|t| t.get("template")).and_then(Value::as_str) {
                Some(s) => Ok(Some(s.to_string())),
                None => Err(RunError::file(
                    path,
                    "chat_template lists no template named 'default'",
                )),
            }
        }
        Some(other) => Err(RunError::file(
            path,
            format!("chat_template must be a string or a list of named templates, found {other}"),
        )),
    }
}

/// Copies a file through a synced temporary in the target's directory and
/// a rename, so `dst` is never seen half-written.
pub fn copy_atomic(src: &Path, dst: &Path) -> Result<()> {
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dst.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let res = (|| {
        std::fs::copy(src, &tmp).map_err(RunError::io(src))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(RunError::io(&tmp))?;
        std::fs::rename(&tmp, dst).map_err(RunError::io(dst))?;
        let parent = dst
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        megatrain_tier::atomic::sync_dir(parent)?;
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// A char vocabulary covering every character the data can produce: the
/// text of text files and directories, and for `.jsonl` the strings of the
/// records plus the chat template.
pub fn char_vocab(corpora: &[&Path]) -> Result<CharTokenizer> {
    let mut text = String::new();
    let mut jsonl = false;
    for &p in corpora {
        let before = text.len();
        // A .jsonl with lines but no strings in them is left to its loader,
        // which names the line at fault.
        let mut has_text = false;
        if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(RunError::io(p))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file() && f.extension().is_some_and(|e| e == "txt"))
                .collect();
            files.sort();
            for f in files {
                text.push_str(&std::fs::read_to_string(&f).map_err(RunError::io(&f))?);
            }
        } else {
            match p.extension().and_then(|e| e.to_str()) {
                Some(ext) if crate::data::id_width(ext).is_some() => {
                    return Err(RunError::file(
                        p,
                        format!(
                            "a .{ext} holds token ids already; a char vocabulary cannot be built from it \
                             (pass --vocab-size, or --tokenizer with the tokenizer that made it)"
                        ),
                    ));
                }
                Some("jsonl") => {
                    jsonl = true;
                    let body = std::fs::read_to_string(p).map_err(RunError::io(p))?;
                    has_text = !body.trim().is_empty();
                    for line in body.lines().filter(|l| !l.trim().is_empty()) {
                        if let Ok(v) = serde_json::from_str::<Value>(line) {
                            collect_strings(&v, &mut text);
                        }
                    }
                }
                _ => text.push_str(&std::fs::read_to_string(p).map_err(RunError::io(p))?),
            }
        }
        // Said here, naming the file: past this point an empty corpus is a
        // vocabulary of 0, which the model's config refuses naming none.
        if text.len() == before && !has_text {
            return Err(DataError::Empty {
                path: p.to_path_buf(),
            }
            .into());
        }
    }
    if jsonl {
        let t = Headers::default();
        for s in [&t.system, &t.user, &t.user_with_input, &t.assistant] {
            text.push_str(s);
        }
    }
    Ok(CharTokenizer::from_corpus(&text))
}

fn collect_strings(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => out.push_str(s),
        Value::Array(a) => a.iter().for_each(|x| collect_strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| collect_strings(x, out)),
        _ => {}
    }
}
