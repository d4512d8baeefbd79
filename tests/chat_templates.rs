//! `.jsonl` rendered by Jinja chat templates gives the text transformers'
//! `apply_chat_template` gives, and counts the assistant turns:
//! `tests/fixtures/chat_templates.json` (`tools/make_chat_golden.py`) holds
//! transformers' renderings of six templates in the shapes of the
//! families' own, over conversations with a system message, several turns
//! and non-ASCII text (and, for Qwen3's, whose renderings rewrite earlier
//! turns and so are cut once per assistant turn, replies with reasoning).
//! A byte-level encoder makes the ids the text's bytes.

use std::path::{Path, PathBuf};

use megatrain::data::{ChatTemplate, JinjaTemplate, Offsets, TextEncoder, load_tokens, strftime_utc};
use serde_json::{Value, json};

struct Bytes;

impl TextEncoder for Bytes {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn eos(&self) -> Option<u32> {
        Some(0)
    }
    fn vocab_size(&self) -> usize {
        256
    }
}

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn template(doc: &Value, name: &str) -> ChatTemplate {
    ChatTemplate::Jinja(JinjaTemplate {
        source: doc["templates"][name].as_str().unwrap().into(),
        bos_token: doc["bos_token"].as_str().unwrap().into(),
        eos_token: doc["eos_token"].as_str().unwrap().into(),
        origin: PathBuf::from(name),
    })
}

/// The text of byte ids, and the text of those the loss counts.
fn texts(ids: &[u32], counted: &[bool]) -> (String, String) {
    let bytes = |keep: &dyn Fn(usize) -> bool| {
        let b: Vec<u8> = (0..ids.len())
            .filter(|&i| keep(i))
            .map(|i| ids[i] as u8)
            .collect();
        String::from_utf8(b).unwrap()
    };
    (bytes(&|_| true), bytes(&|i| counted[i]))
}

#[test]
fn every_template_renders_as_transformers_and_counts_the_assistant_turns() {
    let doc = fixture();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 13);
    let dir = tempfile::tempdir().unwrap();
    let today = strftime_utc("%d %b %Y", now());
    for (i, case) in cases.iter().enumerate() {
        let name = case["template"].as_str().unwrap();
        let path = dir.path().join(format!("c{i}.jsonl"));
        let record = json!({ "messages": case["messages"] });
        std::fs::write(&path, format!("{record}\n")).unwrap();
        let data =
            load_tokens(&path, &Bytes, &template(&doc, name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids: Vec<u32> = data.tokens.iter().collect();
        let mask: Vec<bool> = data.loss_mask.unwrap().iter().collect();
        let (full, counted) = texts(&ids, &mask);
        let want_counted: String = case["counted"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(
            full.replace(&today, "<DATE>"),
            case["full"].as_str().unwrap(),
            "{name}, case {i}"
        );
        assert_eq!(
            counted.replace(&today, "<DATE>"),
            want_counted,
            "{name}, case {i}"
        );
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn every_record_kind_renders_through_a_template() {
    // alpaca, sharegpt and chat records of one conversation give one text.
    let doc = fixture();
    let dir = tempfile::tempdir().unwrap();
    let lines = [
        r#"{"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}"#,
        r#"{"conversations": [{"from": "human", "value": "Translate to French.\n\nGood morning"}, {"from": "gpt", "value": "Bonjour"}]}"#,
        r#"{"messages": [{"role": "user", "content": "Translate to French.\n\nGood morning"}, {"role": "assistant", "content": "Bonjour"}]}"#,
    ];
    let t = template(&doc, "chatml_default_system");
    let rendered: Vec<(String, String)> = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let p = dir.path().join(format!("k{i}.jsonl"));
            std::fs::write(&p, format!("{line}\n")).unwrap();
            let d = load_tokens(&p, &Bytes, &t).unwrap();
            let ids: Vec<u32> = d.tokens.iter().collect();
            texts(&ids, &d.loss_mask.unwrap().iter().collect::<Vec<_>>())
        })
        .collect();
    assert!(rendered.windows(2).all(|w| w[0] == w[1]), "{rendered:?}");
    assert_eq!(rendered[0].1, "Bonjour<|im_end|>\n");
}

#[test]
fn a_template_that_raises_names_the_line() {
    let doc = fixture();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.jsonl");
    // Mistral's template insists on alternating roles.
    std::fs::write(
        &p,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"b\"}]}\n",
    )
    .unwrap();
    let err = load_tokens(&p, &Bytes, &template(&doc, "mistral_style"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("r.jsonl:2:") && err.contains("must alternate"),
        "{err}"
    );
}

/// `--chat-template`: `auto` takes the template a tokenizer ships
/// (`chat_template.jinja` first, then `tokenizer_config.json`, whose
/// token strings fill `bos_token` and `eos_token`), else the Alpaca
/// headers; `alpaca` and paths are taken as said.
#[test]
fn the_chat_template_option_finds_the_tokenizers_template() {
    use megatrain::run::Encoder;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let tok =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures/tokenizer/tokenizer.json");
    std::fs::copy(&tok, dir.join("tokenizer.json")).unwrap();
    let enc = || Encoder::choose(dir.join("tokenizer.json").to_str().unwrap(), None, None, &[]).unwrap();
    assert_eq!(enc().chat_template("auto").unwrap(), ChatTemplate::default());
    let config = json!({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": true},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let jinja = |t: ChatTemplate| match t {
        ChatTemplate::Jinja(j) => (j.source, j.bos_token, j.eos_token),
        other => panic!("{other:?}"),
    };
    let want = (
        "D{{ bos_token }}".to_string(),
        "<s>".to_string(),
        "</s>".to_string(),
    );
    assert_eq!(jinja(enc().chat_template("auto").unwrap()), want);
    std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
    assert_eq!(jinja(enc().chat_template("auto").unwrap()).0, "J");
    assert_eq!(enc().chat_template("alpaca").unwrap(), ChatTemplate::default());
    std::fs::write(dir.join("mine.jinja"), "M").unwrap();
    let mine = dir.join("mine.jinja");
    assert_eq!(jinja(enc().chat_template(mine.to_str().unwrap()).unwrap()).0, "M");
    let cfg = dir.join("tokenizer_config.json");
    assert_eq!(
        jinja(enc().chat_template(cfg.to_str().unwrap()).unwrap()).0,
        "D{{ bos_token }}"
    );
    // Errors name the option or the file.
    let missing = dir.join("none.jinja");
    let err = enc()
        .chat_template(missing.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("none.jinja"), "{err}");
    std::fs::write(&cfg, r#"{"chat_template": [{"name": "x", "template": "T"}]}"#).unwrap();
    let err = enc()
        .chat_template(cfg.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("default"),
        "{err}"
    );
    std::fs::write(dir.join("c.txt"), "abc").unwrap();
    let char_enc = Encoder::choose("char", None, None, &[&dir.join("c.txt")]).unwrap();
    let err = char_enc
        .chat_template(mine.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("--chat-template") && err.contains("char"), "{err}");
    assert_eq!(char_enc.chat_template("auto").unwrap(), ChatTemplate::default());
}

/// A run renders `.jsonl` by its `--chat-template`, keeps the option in
/// its state for `--resume`, and an old state without it means alpaca.
#[test]
fn a_run_trains_on_records_rendered_by_a_template_file() {
    use megatrain::run::{
        Every, QuietProgress, TrainOptions, latest_checkpoint, prepare, read_train_state, train,
    };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    std::fs::write(
        t.join("chat.jinja"),
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}\
         {% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    let record =
        r#"{"messages": [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]}"#;
    std::fs::write(t.join("d.jsonl"), format!("{record}\n").repeat(40)).unwrap();
    let opts = TrainOptions {
        preset: Some("llama-tiny".into()),
        data: vec![t.join("d.jsonl")],
        tokenizer: "byte".into(),
        chat_template: t.join("chat.jinja").to_string_lossy().into_owned(),
        seq_len: 48,
        batch: 2,
        steps: 2,
        eval_every: Every::Steps(1),
        eval_batches: 1,
        val_fraction: 0.1,
        out: t.join("run"),
        ..TrainOptions::default()
    };
    let mut p = prepare(opts, false).unwrap();
    assert!(matches!(p.template, ChatTemplate::Jinja(_)));
    let ids: Vec<u32> = p.train.parts[0].tokens.iter().take(34).collect();
    let text: String = ids.iter().map(|&i| i as u8 as char).collect();
    assert_eq!(text, "<user>ping</user><assistant>pong</");
    let counted: Vec<bool> = p.train.parts[0]
        .loss_mask
        .as_ref()
        .unwrap()
        .iter()
        .take(34)
        .collect();
    assert!(counted[..28].iter().all(|c| !c) && counted[28..].iter().all(|&c| c));
    train(
        megatrain_tensor::CpuExecutor::new(),
        &mut p,
        None,
        &mut QuietProgress,
    )
    .unwrap();
    let state = read_train_state(&latest_checkpoint(&t.join("run")).unwrap()).unwrap();
    assert!(state.options.chat_template.ends_with("chat.jinja"));
    // A state written before the option existed rendered with alpaca.
    let old: TrainOptions = serde_json::from_value(json!({"tokenizer": "byte"})).unwrap();
    assert_eq!(old.chat_template, "alpaca");
    assert_eq!(TrainOptions::default().chat_template, "auto");
}

/// Like a SentencePiece tokenizer that puts a marker before every text it
/// encodes: tokenized piece by piece, a conversation would get one before
/// every piece. With offsets it is encoded whole, as the model sees it.
struct Marking;

impl TextEncoder for Marking {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(std::iter::once(1).chain(text.bytes().map(u32::from)).collect())
    }
    fn encode_with_offsets(&self, text: &str) -> Option<Result<Offsets, String>> {
        let starts = std::iter::once(0).chain(0..text.len()).collect();
        Some(self.encode(text).map(|ids| (ids, starts)))
    }
    fn eos(&self) -> Option<u32> {
        Some(0)
    }
    fn vocab_size(&self) -> usize {
        256
    }
}

#[test]
fn a_conversation_is_tokenized_whole_where_the_tokenizer_gives_offsets() {
    let doc = fixture();
    let dir = tempfile::tempdir().unwrap();
    let case = &doc["cases"][3];
    let p = dir.path().join("w.jsonl");
    let record = json!({ "messages": case["messages"] });
    std::fs::write(&p, format!("{record}\n{record}\n")).unwrap();
    let t = template(&doc, case["template"].as_str().unwrap());
    let whole = load_tokens(&p, &Marking, &t).unwrap();
    let ids: Vec<u32> = whole.tokens.iter().collect();
    let mask: Vec<bool> = whole.loss_mask.unwrap().iter().collect();
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        2,
        "one marker per record"
    );
    // Past the markers, the same bytes and the same counted bytes as
    // tokenized piece by piece.
    let kept: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] != 1).collect();
    let ids: Vec<u32> = kept.iter().map(|&i| ids[i]).collect();
    let mask: Vec<bool> = kept.iter().map(|&i| mask[i]).collect();
    let parts = load_tokens(&p, &Bytes, &t).unwrap();
    assert_eq!(ids, parts.tokens.iter().collect::<Vec<_>>());
    assert_eq!(mask, parts.loss_mask.unwrap().iter().collect::<Vec<_>>());
}

/// With a Hugging Face tokenizer a conversation's ids are those of
/// transformers' `apply_chat_template(tokenize=True)`.
#[test]
fn a_hugging_face_tokenizer_gives_transformers_ids() {
    use megatrain::run::Encoder;
    let doc = fixture();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tokenizer/tokenizer.json");
    let enc = Encoder::choose(tok.to_str().unwrap(), None, None, &[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut compared = 0;
    for (i, case) in doc["cases"].as_array().unwrap().iter().enumerate() {
        let Some(want) = case.get("ids") else { continue };
        let want: Vec<u32> = serde_json::from_value(want.clone()).unwrap();
        let p = dir.path().join(format!("h{i}.jsonl"));
        std::fs::write(&p, format!("{}\n", json!({ "messages": case["messages"] }))).unwrap();
        let t = template(&doc, case["template"].as_str().unwrap());
        let got = load_tokens(&p, &enc, &t).unwrap();
        assert_eq!(got.tokens.iter().collect::<Vec<_>>(), want, "case {i}");
        compared += 1;
    }
    assert_eq!(compared, 11);
}

/// A chat reply ends at any end-of-sequence id the model names: the
/// tokenizer's, `config.json`'s and `generation_config.json`'s (a list in
/// Llama 3's instruct models).
#[test]
fn stop_ids_gather_every_end_of_sequence_id() {
    use megatrain::run::Encoder;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tokenizer/tokenizer.json");
    std::fs::copy(&tok, dir.join("tokenizer.json")).unwrap();
    let mut model = megatrain_zoo::preset("llama-tiny", Some(302)).unwrap();
    model.raw = Some(json!({"eos_token_id": 301}));
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [301, 7, 999]}"#,
    )
    .unwrap();
    let enc = Encoder::choose(dir.join("tokenizer.json").to_str().unwrap(), None, None, &[]).unwrap();
    // 999 is past the vocabulary.
    assert_eq!(enc.stop_ids(&model, dir).unwrap(), [7, 301]);
    std::fs::write(dir.join("generation_config.json"), "{oops").unwrap();
    let err = enc.stop_ids(&model, dir).unwrap_err().to_string();
    assert!(err.contains("generation_config.json"), "{err}");
}

/// The template and the end-of-turn ids travel with the tokenizer into a
/// run's checkpoints, so the trained model renders and stops as it was
/// trained to.
#[test]
fn a_checkpoint_keeps_the_template_and_the_end_of_turn_ids() {
    use megatrain::run::{Encoder, Every, QuietProgress, TrainOptions, latest_checkpoint, prepare, train};
    let doc = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let tok = t.join("tok");
    std::fs::create_dir(&tok).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tokenizer/tokenizer.json");
    std::fs::copy(src, tok.join("tokenizer.json")).unwrap();
    let chatml = doc["templates"]["chatml_default_system"].as_str().unwrap();
    let config = json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": chatml});
    std::fs::write(tok.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        tok.join("generation_config.json"),
        r#"{"eos_token_id": [301, 5]}"#,
    )
    .unwrap();
    let record =
        json!({"messages": [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]});
    std::fs::write(t.join("d.jsonl"), format!("{record}\n").repeat(30)).unwrap();
    let opts = TrainOptions {
        preset: Some("llama-tiny".into()),
        vocab_size: Some(302),
        data: vec![t.join("d.jsonl")],
        tokenizer: tok.join("tokenizer.json").to_string_lossy().into_owned(),
        // Windows of the stream: a row of 16 tokens from a record's start
        // would end inside its default system prompt.
        rows: megatrain::run::RowsKind::Stream,
        seq_len: 16,
        batch: 2,
        steps: 1,
        eval_every: Every::Steps(0),
        val_fraction: 0.0,
        out: t.join("run"),
        ..TrainOptions::default()
    };
    let mut p = prepare(opts, false).unwrap();
    assert!(
        matches!(p.template, ChatTemplate::Jinja(_)),
        "auto found the tokenizer's template"
    );
    train(
        megatrain_tensor::CpuExecutor::new(),
        &mut p,
        None,
        &mut QuietProgress,
    )
    .unwrap();
    let ckpt = latest_checkpoint(&t.join("run")).unwrap();
    let model = megatrain_zoo::ModelConfig::from_dir(&ckpt).unwrap();
    let enc = Encoder::from_dir(&ckpt, Some(&model)).unwrap();
    let prompt = enc
        .chat_template("auto")
        .unwrap()
        .generation_prompt(&[megatrain::data::Message {
            role: "user".into(),
            content: "ping".into(),
        }])
        .unwrap();
    assert!(
        prompt.ends_with("<|im_start|>user\nping<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt}"
    );
    assert_eq!(enc.stop_ids(&model, &ckpt).unwrap(), [5, 301]);
}
