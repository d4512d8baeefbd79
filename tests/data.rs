//! Data formats, sampling and bad-input errors.

use std::path::Path;

use megatrain::data::{
    ChatTemplate, DataError, Headers, IGNORE_INDEX, Sampling, TextEncoder, TokenData, draw_batch,
    keep_in_cache, load_tokens, load_tokens_cached, split_validation,
};

/// Bytes as tokens, with 0 as end-of-sequence: enough to see every boundary.
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

/// A vocabulary too small for most text: encoding itself succeeds, the
/// vocabulary check must catch the ids.
struct Tiny;

impl TextEncoder for Tiny {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Bytes.encode(text)
    }
    fn eos(&self) -> Option<u32> {
        None
    }
    fn vocab_size(&self) -> usize {
        100
    }
}

/// Only a vocabulary size: for token files, which need no encoding.
struct Vocab(usize);

impl TextEncoder for Vocab {
    fn encode(&self, _text: &str) -> Result<Vec<u32>, String> {
        Err("a token file is not encoded".into())
    }
    fn eos(&self) -> Option<u32> {
        None
    }
    fn vocab_size(&self) -> usize {
        self.0
    }
}

fn load(path: &Path) -> Result<TokenData, DataError> {
    load_tokens(path, &Bytes, &ChatTemplate::default())
}

/// `d`'s tokens as the bytes they are, the end of sequence (0) as `|`.
fn spelled(d: &TokenData) -> String {
    d.tokens
        .iter()
        .map(|c| if c == 0 { '|' } else { c as u8 as char })
        .collect()
}

/// `d`'s loss mask, `1` where a target counts.
fn counted_bits(d: &TokenData) -> String {
    let mask = d.loss_mask.as_ref().expect("records have a loss mask");
    mask.iter().map(|m| if m { '1' } else { '0' }).collect()
}

#[test]
fn text_file_and_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("b.txt"), "cd").unwrap();
    std::fs::write(dir.path().join("a.txt"), "ab").unwrap();
    std::fs::write(dir.path().join("skip.md"), "zz").unwrap();
    let d = load(dir.path()).unwrap();
    assert_eq!(d.tokens, vec![97, 98, 99, 100]);
    assert_eq!(d.loss_mask, None);
    let d = load(&dir.path().join("b.txt")).unwrap();
    assert_eq!(d.tokens, vec![99, 100]);
}

#[test]
fn nanogpt_bin_is_little_endian_u16() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("train.bin");
    std::fs::write(&p, [1u8, 0, 0xfe, 0x00, 7, 0]).unwrap();
    let d = load(&p).unwrap();
    assert_eq!(d.tokens, vec![1, 254, 7]);
    // Read in place, not copied into the process's memory; a validation
    // split keeps both parts on the map.
    assert!(d.tokens.is_mapped());
    let (t, v) = split_validation(d, 0.34).unwrap();
    assert!(t.tokens.is_mapped() && v.tokens.is_mapped());
    assert_eq!(t.tokens, vec![1, 254]);
    assert_eq!(v.tokens, vec![7]);

    std::fs::write(&p, [1u8, 0, 0x2c, 0x01]).unwrap();
    match load(&p) {
        Err(DataError::TokenOutOfRange {
            id: 300,
            index: 1,
            vocab: 256,
            ..
        }) => {}
        other => panic!("expected token 300 out of range, got {other:?}"),
    }
    std::fs::write(&p, [1u8, 0, 2]).unwrap();
    let err = load(&p).unwrap_err();
    assert!(matches!(err, DataError::OddBin { len: 3, bits: 16, .. }), "{err}");
    assert!(err.to_string().contains("train.bin"), "{err}");
}

/// A `.u32` holds ids past u16 (Qwen2.5's 151,936, Llama-3's 128,256),
/// read in place like a `.bin`; a length that is not whole u32s, or an id
/// past the vocabulary, is named.
#[test]
fn u32_token_files_are_little_endian_u32() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("train.u32");
    let ids = [7u32, 151_935, 65_536, 0];
    std::fs::write(&p, ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let d = load_tokens(&p, &Vocab(151_936), &ChatTemplate::default()).unwrap();
    assert!(d.tokens.is_mapped());
    assert_eq!(d.tokens, ids.to_vec());
    let err = load_tokens(&p, &Vocab(151_935), &ChatTemplate::default()).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                id: 151_935,
                index: 1,
                ..
            }
        ),
        "{err}"
    );
    std::fs::write(&p, [1u8, 0, 0, 0, 2, 0]).unwrap();
    let err = load_tokens(&p, &Vocab(10), &ChatTemplate::default()).unwrap_err();
    assert!(matches!(err, DataError::OddBin { len: 6, bits: 32, .. }), "{err}");
    assert!(
        err.to_string().contains("train.u32") && err.to_string().contains("u32 tokens"),
        "{err}"
    );
}

#[test]
fn empty_and_missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("empty.txt");
    std::fs::write(&p, "").unwrap();
    let err = load(&p).unwrap_err();
    assert!(matches!(err, DataError::Empty { .. }));
    assert!(err.to_string().contains("empty.txt"));
    let err = load(&dir.path().join("nope.txt")).unwrap_err();
    assert!(err.to_string().contains("nope.txt"), "{err}");
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    assert!(matches!(load(&sub).unwrap_err(), DataError::Empty { .. }));
}

#[test]
fn vocabulary_is_checked_on_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.txt");
    std::fs::write(&p, "ab").unwrap(); // 97, 98: 'b' is fine, both < 100
    assert!(load_tokens(&p, &Tiny, &ChatTemplate::default()).is_ok());
    std::fs::write(&p, "az").unwrap(); // 'z' = 122 >= 100
    match load_tokens(&p, &Tiny, &ChatTemplate::default()) {
        Err(DataError::TokenOutOfRange {
            id: 122, index: 1, ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn alpaca_counts_only_the_response_and_eos() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let t = letters();
    std::fs::write(
        &p,
        "{\"instruction\":\"x\",\"input\":\"\",\"output\":\"yz\"}\n\n{\"instruction\":\"q\",\"input\":\"i\",\"output\":\"r\"}\n",
    )
    .unwrap();
    let d = load_tokens(&p, &Bytes, &t).unwrap();
    let text = spelled(&d);
    assert_eq!(text, "UxAyz|UqIiAr|");
    let mask = counted_bits(&d);
    assert_eq!(mask, "0001110000011");
}

/// A document record (`{"text": ...}`, as pretraining sets store them) is
/// its text and the end-of-sequence id, every token counted, whatever the
/// template; a record with both a text and a conversation is the
/// conversation; one with neither names the forms.
#[test]
fn text_records_count_every_token_and_end_with_eos() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    std::fs::write(
        &p,
        "{\"text\":\"ab\"}\n{\"text\":\"c\",\"id\":7}\n{\"instruction\":\"x\",\"output\":\"y\",\"text\":\"ignored\"}\n",
    )
    .unwrap();
    let d = load_tokens(&p, &Bytes, &letters()).unwrap();
    let text = spelled(&d);
    assert_eq!(text, "ab|c|UxAy|");
    let mask = counted_bits(&d);
    assert_eq!(mask, "1111100011");
    assert_eq!(d.records.unwrap().starts(), &[0, 3, 5]);
    for (line, want) in [
        ("{\"text\": 3}", "field 'text' must be a string"),
        ("{\"body\": \"x\"}", "neither 'text' (a document)"),
    ] {
        std::fs::write(&p, format!("{{\"text\":\"ok\"}}\n{line}\n")).unwrap();
        let err = load_tokens(&p, &Bytes, &letters()).unwrap_err().to_string();
        assert!(err.contains("d.jsonl:2") && err.contains(want), "{err}");
    }
}

/// Windows of records: rows of the stream where each record keeps to
/// itself. Every row holds `seq_len` tokens (no padding); its documents
/// start where records start in it; the target of a record's last token
/// is ignored and every other target is the stream's next token; the
/// same with a window that wraps past the stream's end.
#[test]
fn windows_of_records_keep_each_record_to_itself() {
    let starts = vec![0usize, 3, 4, 11, 30, 31, 50];
    let n = 57;
    let data = TokenData {
        tokens: (0..n as u32).map(|i| i + 1).collect::<Vec<_>>().into(),
        loss_mask: None,
        records: Some(megatrain::data::Records::new(starts.clone())),
    }
    .windows();
    let seq = 9;
    for sampling in [Sampling::Sequential, Sampling::Random { seed: 3 }] {
        for index in 0..20u64 {
            let b = draw_batch(&data, sampling, index, 3, seq, "mem".as_ref()).unwrap();
            assert_eq!(b.lengths, None);
            for row in 0..3 {
                let inputs = &b.inputs[row * seq..(row + 1) * seq];
                let start = (inputs[0] - 1) as usize;
                let pos = |i: usize| (start + i) % n;
                let mut want_starts = vec![0];
                for (i, &input) in inputs.iter().enumerate() {
                    assert_eq!(input as usize, pos(i) + 1);
                    let next = pos(i + 1);
                    let boundary = starts.contains(&next);
                    let target = b.targets[row * seq + i];
                    match boundary {
                        true => assert_eq!(target, IGNORE_INDEX, "{sampling:?} {index} row {row} at {i}"),
                        false => assert_eq!(target as usize, next + 1),
                    }
                    if boundary && i + 1 < seq {
                        want_starts.push(i + 1);
                    }
                }
                let got = b
                    .docs
                    .as_ref()
                    .map(|d| (0..seq).filter(|&i| d.start(row, i) == i).collect::<Vec<_>>());
                match want_starts.len() {
                    1 => assert!(got.as_ref().is_none_or(|s| s == &[0]), "{got:?}"),
                    _ => assert_eq!(got, Some(want_starts), "{sampling:?} {index} row {row}"),
                }
            }
        }
    }
}

/// A token file's documents, each ended by an id (nanoGPT's prepared
/// corpora put `<|endoftext|>` after each): the same starts read in place
/// as held in memory, the first at 0, none past the end (a last id ends
/// the stream), and windows drawn from them keep each to itself.
#[test]
fn documents_ended_by_an_id_start_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("docs.bin");
    let ids: Vec<u16> = [5u16, 6, 9, 7, 9, 9, 1, 2, 3, 4, 8, 9].repeat(3);
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&p, bytes).unwrap();
    let mapped = load_tokens(&p, &Vocab(10), &ChatTemplate::default()).unwrap();
    assert!(mapped.tokens.is_mapped());
    let owned = TokenData {
        tokens: ids.iter().map(|&t| u32::from(t)).collect::<Vec<_>>().into(),
        loss_mask: None,
        records: None,
    };
    let want = [0, 3, 5, 6, 12, 15, 17, 18, 24, 27, 29, 30];
    for d in [mapped, owned] {
        let d = d.documents_ended_by(9);
        let r = d.records.as_ref().unwrap();
        assert!(r.is_windows());
        assert_eq!(r.starts(), want);
        let b = draw_batch(&d, Sampling::Sequential, 0, 1, 8, "docs.bin".as_ref()).unwrap();
        assert_eq!(
            b.targets[2], IGNORE_INDEX,
            "9 ends a document: it predicts nothing"
        );
        let docs = b.docs.unwrap();
        assert_eq!((docs.start(0, 4), docs.position(0, 7)), (3, 1));
    }
}

#[test]
fn sharegpt_counts_assistant_turns() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.jsonl");
    let t = ChatTemplate::Headers(Headers {
        system: "S{text}".into(),
        user: "U{text}".into(),
        user_with_input: "unused".into(),
        assistant: "A".into(),
    });
    std::fs::write(
        &p,
        r#"{"conversations":[{"from":"system","value":"s"},{"from":"human","value":"h"},{"from":"gpt","value":"g"},{"from":"human","value":"k"},{"from":"gpt","value":"m"}]}"#,
    )
    .unwrap();
    let d = load_tokens(&p, &Bytes, &t).unwrap();
    let text = spelled(&d);
    assert_eq!(text, "SsUhAg|UkAm|");
    let mask = counted_bits(&d);
    assert_eq!(mask, "000001100011");
}

#[test]
fn bad_jsonl_names_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.jsonl");
    let cases = [
        ("{\"instruction\":\"x\"}", "missing field 'output'"),
        (
            "{\"instruction\":\"x\",\"output\":3}",
            "field 'output' must be a string",
        ),
        ("not json", "invalid JSON"),
        (
            "{\"body\":\"x\"}",
            "neither 'text' (a document), 'instruction' (alpaca), 'conversations' (sharegpt) nor 'messages'",
        ),
        (
            "{\"conversations\":[{\"from\":\"bot\",\"value\":\"v\"}]}",
            "turn 0: unknown role 'bot'",
        ),
        (
            "{\"messages\":[{\"role\":\"user\"}]}",
            "messages[0]: missing field 'content'",
        ),
        (
            "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
            "messages[0]: field 'content' must be a string",
        ),
        (
            "{\"conversations\":[{\"from\":\"gpt\"}]}",
            "conversations[0]: missing field 'value'",
        ),
        ("{\"conversations\":[]}", "empty"),
    ];
    for (line, want) in cases {
        std::fs::write(
            &p,
            format!("{{\"instruction\":\"ok\",\"output\":\"ok\"}}\n{line}\n"),
        )
        .unwrap();
        let err = load(&p).unwrap_err().to_string();
        assert!(err.contains("bad.jsonl:2:"), "{err}");
        assert!(err.contains(want), "{err} should contain {want}");
    }
}

fn stream(n: u32) -> TokenData {
    TokenData {
        tokens: (0..n).collect(),
        loss_mask: None,
        records: None,
    }
}

#[test]
fn sequential_sampling_follows_the_offset_rule_and_wraps() {
    let d = stream(10);
    let name = Path::new("mem");
    // step 1, B = 2, T = 3: sequences start at (1*2+0)*3 = 6 and (1*2+1)*3 = 9.
    let b = draw_batch(&d, Sampling::Sequential, 1, 2, 3, name).unwrap();
    assert_eq!(b.inputs, vec![6, 7, 8, 9, 0, 1]);
    assert_eq!(b.targets, vec![7, 8, 9, 0, 1, 2]);
    assert_eq!(b.counted(), 6);
}

#[test]
fn random_sampling_is_seeded_and_in_range() {
    let d = stream(50);
    let name = Path::new("mem");
    let a = draw_batch(&d, Sampling::Random { seed: 7 }, 3, 4, 8, name).unwrap();
    let b = draw_batch(&d, Sampling::Random { seed: 7 }, 3, 4, 8, name).unwrap();
    let c = draw_batch(&d, Sampling::Random { seed: 8 }, 3, 4, 8, name).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    for row in 0..4 {
        let r = &a.inputs[row * 8..row * 8 + 8];
        let t = &a.targets[row * 8..row * 8 + 8];
        assert!(
            r.windows(2).all(|w| w[1] == w[0] + 1),
            "random windows never wrap: {r:?}"
        );
        assert!(r.iter().zip(t).all(|(&i, &t)| t == i as i32 + 1));
    }
}

#[test]
fn masked_targets_are_ignored_and_short_data_is_an_error() {
    let mut d = stream(6);
    d.loss_mask = Some(vec![true, false, true, true, false, true].into());
    let b = draw_batch(&d, Sampling::Sequential, 0, 1, 5, Path::new("mem")).unwrap();
    assert_eq!(b.targets, vec![IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]);
    let err = draw_batch(&d, Sampling::Sequential, 0, 1, 6, Path::new("short.txt")).unwrap_err();
    assert!(err.to_string().contains("short.txt"), "{err}");
}

#[test]
fn validation_split_takes_the_tail() {
    let mut d = stream(20);
    d.loss_mask = Some(vec![true; 20].into());
    let (t, v) = split_validation(d, 0.1).unwrap();
    assert_eq!(t.tokens, (0..18).collect::<Vec<_>>());
    assert_eq!(v.tokens, vec![18, 19]);
    assert_eq!(v.loss_mask.unwrap().len(), 2);
    assert!(split_validation(stream(3), 1.0).is_err());
    assert!(split_validation(stream(3), -0.1).is_err());
    // Documents in windows split between documents; one document alone
    // where the fraction falls, each part a document of its own.
    let (t, v) = split_validation(stream(20).documents_ended_by(11), 0.3).unwrap();
    assert_eq!((t.len(), v.len()), (12, 8));
    assert_eq!(v.records.as_ref().unwrap().starts(), &[0]);
    let (t, v) = split_validation(stream(20).documents_ended_by(99), 0.1).unwrap();
    assert_eq!((t.len(), v.len()), (18, 2));
    for d in [&t, &v] {
        let r = d.records.as_ref().unwrap();
        assert!(r.is_windows() && r.starts() == [0]);
    }
}

/// Bytes as tokens, counting its calls, with a cache key of choice.
struct Counted {
    key: Option<&'static str>,
    calls: std::sync::atomic::AtomicUsize,
}

impl TextEncoder for Counted {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Bytes.encode(text)
    }
    fn eos(&self) -> Option<u32> {
        None
    }
    fn vocab_size(&self) -> usize {
        256
    }
    fn cache_key(&self) -> Option<String> {
        self.key.map(String::from)
    }
}

#[test]
fn a_texts_ids_are_cached_by_text_and_tokenizer_and_mapped_from_there() {
    let dir = tempfile::tempdir().unwrap();
    let (text, cache) = (dir.path().join("corpus.txt"), dir.path().join("tokens"));
    std::fs::write(&text, "hello world").unwrap();
    let t = ChatTemplate::default();
    let enc = |key| Counted {
        key,
        calls: std::sync::atomic::AtomicUsize::new(0),
    };
    let cached = |e: &Counted| load_tokens_cached(&text, e, &t, Some(&cache)).unwrap();
    let files = || {
        let mut v: Vec<String> = std::fs::read_dir(&cache)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let want: Vec<u32> = "hello world".bytes().map(u32::from).collect();

    let k1 = enc(Some("k1"));
    let first = cached(&k1);
    assert_eq!(
        (
            first.tokens.clone(),
            k1.calls.load(std::sync::atomic::Ordering::SeqCst)
        ),
        (want.clone().into(), 1)
    );
    assert!(first.tokens.is_mapped(), "written, then mapped");
    assert_eq!(files().len(), 1);
    let again = cached(&k1);
    assert_eq!(
        (
            again.tokens.is_mapped(),
            k1.calls.load(std::sync::atomic::Ordering::SeqCst)
        ),
        (true, 1),
        "mapped, not tokenized"
    );
    assert_eq!(again.tokens, want);

    // Another tokenizer: tokenized again, the old ids removed.
    let k2 = enc(Some("k2"));
    cached(&k2);
    assert_eq!(k2.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    let after_k2 = files();
    assert!(
        after_k2.len() == 1 && after_k2[0].starts_with("corpus.txt-"),
        "{after_k2:?}"
    );
    // An edited text: the same.
    std::fs::write(&text, "hello, world!").unwrap();
    assert_eq!(
        cached(&k2).tokens,
        "hello, world!".bytes().map(u32::from).collect::<Vec<_>>()
    );
    assert_eq!(k2.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(files().len() == 1 && files() != after_k2);
    // A cache file of another data set that shares the prefix stays.
    std::fs::write(cache.join("corpus.txt-x-0123456789abcdef.u32"), [0u8; 4]).unwrap();
    std::fs::write(&text, "once more").unwrap();
    cached(&k2);
    assert_eq!(files().len(), 2);
    // A tokenizer without a key caches nothing.
    let none = enc(None);
    let other = dir.path().join("other.txt");
    std::fs::write(&other, "abc").unwrap();
    let d = load_tokens_cached(&other, &none, &t, Some(&cache)).unwrap();
    assert!(!d.tokens.is_mapped() && files().len() == 2);
}

/// Ids tokenized before a run directory existed (a fresh run) move there
/// once it does: the same ids, mapped, a validation split's two parts as
/// two ranges of one file that a later load maps without tokenizing.
/// Token files and ids mapped already stay as they are.
#[test]
fn ids_held_in_memory_move_to_the_cache_and_are_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let (text, cache) = (dir.path().join("corpus.txt"), dir.path().join("run/tokens"));
    std::fs::write(&text, "hello world, once more").unwrap();
    let t = ChatTemplate::default();
    let k = Counted {
        key: Some("k"),
        calls: std::sync::atomic::AtomicUsize::new(0),
    };
    let all = load_tokens(&text, &k, &t).unwrap();
    let want = all.tokens.to_vec();
    let (mut train, mut val) = split_validation(all, 0.25).unwrap();
    let (tl, vl) = (train.tokens.to_vec(), val.tokens.to_vec());
    assert!(!train.tokens.is_mapped());
    keep_in_cache(&text, &k, &t, &cache, &mut [&mut train, &mut val]).unwrap();
    assert!(train.tokens.is_mapped() && val.tokens.is_mapped());
    assert_eq!((train.tokens.to_vec(), val.tokens.to_vec()), (tl, vl));
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
    let again = load_tokens_cached(&text, &k, &t, Some(&cache)).unwrap();
    assert_eq!(
        (
            again.tokens.to_vec(),
            k.calls.load(std::sync::atomic::Ordering::SeqCst)
        ),
        (want, 1),
        "mapped, not tokenized"
    );

    // Mapped already, or not a text: nothing is written.
    let other = dir.path().join("other");
    keep_in_cache(&text, &k, &t, &other, &mut [&mut train]).unwrap();
    let bin = dir.path().join("ids.bin");
    std::fs::write(&bin, [1u8, 0, 2, 0]).unwrap();
    let mut ids = load_tokens(&bin, &k, &t).unwrap();
    ids.tokens = ids.tokens.to_vec().into();
    keep_in_cache(&bin, &k, &t, &other, &mut [&mut ids]).unwrap();
    assert!(!ids.tokens.is_mapped() && !other.exists());
}

/// An instruction set's ids and loss mask are kept like a text's ids: a
/// fresh run's (held in memory, with a validation split) move to the cache
/// and are mapped, each mask in its ids' top bits; a later load maps them
/// without tokenizing, and draws the same batches; another chat template
/// or an edited file tokenizes again and replaces the file.
#[test]
fn instruction_ids_and_masks_are_cached_and_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let (data, cache) = (dir.path().join("sft.jsonl"), dir.path().join("run/tokens"));
    let records = "{\"instruction\":\"add\",\"input\":\"2 2\",\"output\":\"4\"}\n\
                   {\"conversations\":[{\"from\":\"human\",\"value\":\"hi\"},{\"from\":\"gpt\",\"value\":\"hello\"}]}\n"
        .repeat(20);
    std::fs::write(&data, &records).unwrap();
    let t = ChatTemplate::default();
    let k = Counted {
        key: Some("k"),
        calls: std::sync::atomic::AtomicUsize::new(0),
    };
    let calls = || k.calls.load(std::sync::atomic::Ordering::SeqCst);
    let all = load_tokens(&data, &k, &t).unwrap();
    let mask: Vec<bool> = all.loss_mask.as_ref().unwrap().iter().collect();
    assert!(mask.contains(&true) && mask.contains(&false));
    let (mut train, mut val) = split_validation(all.clone(), 0.25).unwrap();
    let (want_train, want_val) = (train.clone(), val.clone());
    keep_in_cache(&data, &k, &t, &cache, &mut [&mut train, &mut val]).unwrap();
    assert!(train.tokens.is_mapped() && val.tokens.is_mapped());
    assert_eq!((&train, &val), (&want_train, &want_val));
    let names: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.len() == 1 && names[0].ends_with(".u32m"), "{names:?}");

    let tokenized = calls();
    let again = load_tokens_cached(&data, &k, &t, Some(&cache)).unwrap();
    assert_eq!(
        (again.tokens.is_mapped(), calls()),
        (true, tokenized),
        "mapped, not tokenized"
    );
    assert_eq!(again, all);
    for i in 0..5 {
        let s = Sampling::Random { seed: 3 };
        let (a, b) = (
            draw_batch(&again, s, i, 2, 8, &data).unwrap(),
            draw_batch(&all, s, i, 2, 8, &data).unwrap(),
        );
        assert_eq!(
            (a.counted(), a.inputs, a.targets),
            (b.counted(), b.inputs, b.targets)
        );
    }

    // Another template shapes other ids: tokenized again, one file kept.
    let t2 = ChatTemplate::Headers(Headers {
        assistant: "### Answer:\n".into(),
        ..Headers::default()
    });
    let other = load_tokens_cached(&data, &k, &t2, Some(&cache)).unwrap();
    assert!(calls() > tokenized && other.tokens.is_mapped() && other.tokens != all.tokens);
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
    // An edited file: the same.
    let before = calls();
    std::fs::write(&data, records.replace("hello", "howdy")).unwrap();
    let edited = load_tokens_cached(&data, &k, &t2, Some(&cache)).unwrap();
    assert!(calls() > before && edited.tokens != other.tokens);
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
}

/// A mixture: each row comes whole from one source, the sources' shares
/// follow the weights, the draw is a function of (seed, batch, row), and
/// one source alone draws exactly what `draw_rows` does.
#[test]
fn a_mixture_draws_whole_rows_by_weight() {
    use megatrain::data::{Mix, draw_mix_rows, draw_rows};
    use std::path::PathBuf;
    let a = stream(500);
    let b = TokenData {
        tokens: (1000..1300).collect(),
        loss_mask: None,
        records: None,
    };
    let mix = Mix {
        parts: vec![a.clone(), b],
        weights: vec![3.0, 1.0],
    };
    let names = [PathBuf::from("a"), PathBuf::from("b")];
    let s = Sampling::Random { seed: 11 };
    let (mut rows_a, mut rows_b) = (0, 0);
    for i in 0..200 {
        let batch = draw_mix_rows(&mix, s, i, 8, 0..8, 16, &names).unwrap();
        assert_eq!(batch, draw_mix_rows(&mix, s, i, 8, 0..8, 16, &names).unwrap());
        // Rows 2..5 of the batch are those rows of the whole batch.
        let part = draw_mix_rows(&mix, s, i, 8, 2..5, 16, &names).unwrap();
        assert_eq!(part.inputs, batch.inputs[2 * 16..5 * 16]);
        for row in batch.inputs.chunks(16) {
            match (row.iter().all(|&t| t < 500), row.iter().all(|&t| t >= 1000)) {
                (true, false) => rows_a += 1,
                (false, true) => rows_b += 1,
                _ => panic!("a row mixes sources: {row:?}"),
            }
        }
    }
    // 1600 rows at 3:1: 1200 ± 4σ (σ ≈ 17).
    assert!((1130..=1270).contains(&rows_a), "{rows_a} of {}", rows_a + rows_b);
    let alone = Mix::one(a.clone());
    for i in 0..5 {
        assert_eq!(
            draw_mix_rows(&alone, s, i, 4, 0..4, 16, &names[..1]).unwrap(),
            draw_rows(&a, s, i, 4, 0..4, 16, &names[0]).unwrap()
        );
    }
    let short = Mix {
        parts: vec![a, stream(10)],
        weights: vec![1.0, 1.0],
    };
    let err = draw_mix_rows(&short, s, 0, 4, 0..4, 16, &names)
        .unwrap_err()
        .to_string();
    assert!(err.contains("b:") && err.contains("16"), "{err}");
}

/// Headers of one letter each: S, U (I before an input) and A.
fn letters() -> ChatTemplate {
    ChatTemplate::Headers(Headers {
        system: "S{text}".into(),
        user: "U{text}".into(),
        user_with_input: "U{text}I{input}".into(),
        assistant: "A".into(),
    })
}

/// Three alpaca records under one-letter headers: "UaAbc|" (6 tokens),
/// "UdAe|" (5) and "UfghijklAmnopq|" (15), `|` the end-of-sequence id 0.
fn three_records(dir: &Path) -> (std::path::PathBuf, TokenData) {
    let p = dir.join("r.jsonl");
    let t = letters();
    std::fs::write(
        &p,
        "{\"instruction\":\"a\",\"output\":\"bc\"}\n{\"instruction\":\"d\",\"output\":\"e\"}\n\
         {\"instruction\":\"fghijkl\",\"output\":\"mnopq\"}\n",
    )
    .unwrap();
    let d = load_tokens(&p, &Bytes, &t).unwrap();
    (p, d)
}

/// A row as text: inputs (`.` for padding) and the counted targets (`_`
/// where the loss ignores the position).
fn row_text(b: &megatrain::data::Batch, r: usize) -> (String, String) {
    let t = b.seq_len;
    let ch = |c: u32| if c == 0 { '|' } else { c as u8 as char };
    let inputs = b.inputs[r * t..(r + 1) * t].iter().map(|&c| ch(c)).collect();
    let targets = b.targets[r * t..(r + 1) * t]
        .iter()
        .map(|&c| if c == IGNORE_INDEX { '_' } else { ch(c as u32) })
        .collect();
    (inputs, targets)
}

/// Rows of records: each starts at its record's first token and ends with
/// it (the last token's target ignored: what follows is another record),
/// padded with id 0 and ignored targets, a long record cut at T + 1
/// tokens; in order, record g·B + b; at random, every record once a pass.
#[test]
fn rows_of_records_start_at_a_record_and_are_padded() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = three_records(dir.path());
    assert_eq!(d.records.as_ref().unwrap().starts(), &[0, 6, 11]);
    let b = draw_batch(&d, Sampling::Sequential, 0, 3, 8, &p).unwrap();
    let rows: Vec<_> = (0..3).map(|r| row_text(&b, r)).collect();
    // Padding reads as id 0 ('|') too; its targets are ignored.
    assert_eq!(rows[0], ("UaAbc|||".into(), "__bc|___".into()));
    assert_eq!(rows[1], ("UdAe||||".into(), "__e|____".into()));
    // 15 tokens, cut at 9: its response's first tokens only.
    assert_eq!(
        rows[2],
        ("UfghijklA".chars().take(8).collect(), "________".into())
    );
    let b = draw_batch(&d, Sampling::Sequential, 0, 1, 10, &p).unwrap();
    assert_eq!(row_text(&b, 0).0, "UaAbc|||||");
    // Batch 1 of 2 rows: records 2 and 0 (wrapping).
    let b = draw_batch(&d, Sampling::Sequential, 1, 2, 14, &p).unwrap();
    assert_eq!(
        row_text(&b, 0),
        ("UfghijklAmnopq".into(), "________mnopq|".into())
    );
    assert_eq!(row_text(&b, 1).0, "UaAbc|||||||||");
    assert_eq!(b.counted(), 6 + 3);

    // At random: each pass of three rows holds every record once.
    for pass in 0..4u64 {
        let s = Sampling::Random { seed: 11 };
        let b = draw_batch(&d, s, pass, 3, 16, &p).unwrap();
        let mut firsts: Vec<String> = (0..3).map(|r| row_text(&b, r).0[..2].to_string()).collect();
        firsts.sort();
        assert_eq!(firsts, ["Ua", "Ud", "Uf"], "pass {pass}");
    }
    // As a stream, the same data draws windows across records.
    let b = draw_batch(&d.clone().as_stream(), Sampling::Sequential, 1, 1, 8, &p).unwrap();
    assert_eq!(row_text(&b, 0).0, "Ae|Ufghi");
}

/// An instruction set's validation split falls between records: the
/// records that start in its last fraction (at least the last one); one
/// record cannot be split.
#[test]
fn validation_split_of_records_is_between_records() {
    let dir = tempfile::tempdir().unwrap();
    let (_, d) = three_records(dir.path());
    let (t, v) = split_validation(d.clone(), 0.5).unwrap();
    assert_eq!((t.len(), v.len()), (11, 15));
    assert_eq!(t.records.as_ref().unwrap().starts(), &[0, 6]);
    assert_eq!(v.records.as_ref().unwrap().starts(), &[0]);
    let (t, v) = split_validation(d.clone(), 0.01).unwrap();
    assert_eq!((t.len(), v.len()), (11, 15), "at least the last record");
    let (t, v) = split_validation(d.clone(), 0.0).unwrap();
    assert_eq!((t.records.unwrap().len(), v.records.unwrap().len()), (3, 0));
    let (_, one) = split_validation(d, 0.5).unwrap();
    let err = split_validation(one, 0.1).unwrap_err();
    assert!(matches!(err, DataError::OneRecord(_)), "{err}");
}

/// Where the records start survives the cache: the flag bit below the
/// mask's, set on each record's first word; a later load maps them.
#[test]
fn record_starts_are_cached_with_the_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = three_records(dir.path());
    let cache = dir.path().join("tokens");
    let k = Counted {
        key: Some("k"),
        calls: std::sync::atomic::AtomicUsize::new(0),
    };
    let t = letters();
    // No end-of-sequence id under this encoder: records of 5, 4 and 14.
    let all = load_tokens(&p, &k, &t).unwrap();
    assert_eq!(all.records.as_ref().unwrap().starts(), &[0, 5, 9]);
    assert_eq!(all.len() + 3, d.len());
    let (mut train, mut val) = split_validation(all.clone(), 0.5).unwrap();
    keep_in_cache(&p, &k, &t, &cache, &mut [&mut train, &mut val]).unwrap();
    assert!(train.tokens.is_mapped() && val.tokens.is_mapped());
    assert_eq!(train.records.as_ref().unwrap().starts(), &[0, 5]);
    let again = load_tokens_cached(&p, &k, &t, Some(&cache)).unwrap();
    assert!(again.tokens.is_mapped());
    assert_eq!(again.records.as_ref().unwrap().starts(), &[0, 5, 9]);
    assert_eq!(again, all, "ids and mask read past both flags");
}
