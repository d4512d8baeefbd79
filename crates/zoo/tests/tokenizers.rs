//! Tokenizers: an HF byte-level BPE `tokenizer.json` written by transformers
//! (encodings compared with what transformers produced), char and byte.

use crate::common;

use common::fixture;
use megatrain_zoo::{CHAR_VOCAB_FILE, CharTokenizer, Tokenizer, ZooError};

#[test]
fn hf_tokenizer_json_matches_transformers() {
    let dir = fixture("tokenizer");
    let tok = Tokenizer::from_dir(&dir)
        .unwrap()
        .expect("tokenizer.json present");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    assert_eq!(tok.vocab_size() as u64, expected["vocab_size"].as_u64().unwrap());
    let samples = expected["samples"].as_array().unwrap();
    assert!(samples.len() >= 4);
    for s in samples {
        let text = s["text"].as_str().unwrap();
        let want: Vec<u32> = s["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(
            tok.decode(&ids).unwrap(),
            s["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn bad_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, "{\"model\": 3}").unwrap();
    let msg = Tokenizer::from_hf_file(&path).unwrap_err().to_string();
    assert!(msg.contains("tokenizer.json"), "{msg}");
}

#[test]
fn char_tokenizer_on_tinyshakespeare_shape() {
    let corpus = "First Citizen:\nBefore we proceed any further, hear me speak.\n";
    let tok = CharTokenizer::from_corpus(corpus);
    let ids = tok.encode("hear me").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "hear me");
    // Sorted unique characters: '\n' and ' ' first.
    assert_eq!(tok.chars()[..2], ['\n', ' ']);
    let err = tok.encode("hear Z").unwrap_err();
    assert!(
        matches!(err, ZooError::UnknownChar { ch: 'Z', pos: 5 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("'Z'"));
    assert!(tok.decode(&[999]).is_err());

    let dir = tempfile::tempdir().unwrap();
    tok.save(dir.path().join(CHAR_VOCAB_FILE)).unwrap();
    match Tokenizer::from_dir(dir.path()).unwrap() {
        Some(Tokenizer::Char(back)) => assert_eq!(back, tok),
        other => panic!("expected a char tokenizer, got {other:?}"),
    }
}

#[test]
fn tinyshakespeare_has_65_chars_when_present() {
    // The shared corpus sits beside the repository on team machines and CI.
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/tinyshakespeare.txt");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return;
    };
    let tok = CharTokenizer::from_corpus(&text);
    assert_eq!(tok.vocab_size(), 65);
    let cfg = megatrain_zoo::preset("gpt2-nano", Some(tok.vocab_size())).unwrap();
    assert_eq!(cfg.vocab_size, 65);
}

#[test]
fn byte_tokenizer() {
    let tok = Tokenizer::Byte;
    assert_eq!(tok.vocab_size(), 256);
    let ids = tok.encode("é!").unwrap();
    assert_eq!(ids, [0xC3, 0xA9, b'!' as u32]);
    assert_eq!(tok.decode(&ids).unwrap(), "é!");
    assert!(tok.decode(&[256]).is_err());
}
