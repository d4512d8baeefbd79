//! A long text through a Hugging Face tokenizer in pieces, on every core,
//! with the ids of encoding it whole.
//!
//! Encoding a corpus in one call keeps, per token, its string, offsets,
//! masks and ids (≈ 70 bytes and an allocation) on one core: a 1 GB text
//! would take tens of GB. Here each piece of [`PIECE`] bytes is encoded
//! with [`MARGIN`] bytes of the text on either side, and two neighbours are
//! joined at a token both give alike, ids and offsets, with [`AGREE`]
//! tokens around it alike too: there both have left the edges of their
//! text behind (the first word of a piece, a SentencePiece prefix, a merge
//! cut short), so both are what the whole text gives. Where no such token
//! is found near a cut, `None` says to encode the text whole.

use rayon::prelude::*;

/// Bytes of text per piece.
pub(crate) const PIECE: usize = 1 << 20;
/// Bytes of text each piece is encoded with past its ends.
pub(crate) const MARGIN: usize = 4 << 10;
/// Tokens on each side of a join that both neighbours must give alike.
const AGREE: usize = 16;

/// The ids of a text and each token's byte offsets in it.
pub(crate) type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// A piece's ids and the offsets of the tokens near its two cuts.
struct Piece {
    ids: Vec<u32>,
    /// `(byte offset, id)` of the tokens that start before `cut + margin`.
    head: Vec<(usize, u32)>,
    /// Index in `ids` of `tail[0]`.
    tail_at: usize,
    /// `(byte offset, id)` of the tokens that start at or after
    /// `next cut − margin`.
    tail: Vec<(usize, u32)>,
}

fn floor_char(text: &str, mut i: usize) -> usize {
    i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Encodes `text` with `encode` (ids and byte offsets of a text) in pieces
/// of about `piece` bytes seen with `margin` bytes around them; `None`
/// where two pieces never agree near their cut.
pub(crate) fn encode_in_pieces<E: Send>(
    text: &str,
    piece: usize,
    margin: usize,
    encode: impl Fn(&str) -> Result<Encoded, E> + Sync,
) -> Result<Option<Vec<u32>>, E> {
    let n = text.len().div_ceil(piece.max(1)).max(1);
    let cuts: Vec<usize> = (0..=n).map(|k| floor_char(text, k * piece)).collect();
    let pieces: Vec<Piece> = (0..n)
        .into_par_iter()
        .map(|k| {
            let (lo, hi) = (cuts[k], cuts[k + 1]);
            let from = floor_char(text, lo.saturating_sub(margin));
            let to = floor_char(text, hi + margin);
            let (ids, offsets) = encode(&text[from..to])?;
            let at = |i: usize| offsets[i].0 + from;
            let head_len = (0..ids.len()).take_while(|&i| at(i) < lo + margin).count();
            let tail_at = (0..ids.len())
                .position(|i| at(i) >= hi.saturating_sub(margin))
                .unwrap_or(ids.len());
            let pairs = |r: std::ops::Range<usize>| r.map(|i| (at(i), ids[i])).collect();
            Ok(Piece {
                head: pairs(0..head_len),
                tail: pairs(tail_at..ids.len()),
                tail_at,
                ids,
            })
        })
        .collect::<Result<_, E>>()?;
    // (end in piece k, start in piece k + 1) of each join.
    let mut joins = Vec::with_capacity(n - 1);
    for k in 1..n {
        match join(&pieces[k - 1], &pieces[k], cuts[k], margin) {
            Some(j) => joins.push(j),
            None => return Ok(None),
        }
    }
    let mut out = Vec::with_capacity(pieces.iter().map(|p| p.ids.len()).sum());
    for (k, p) in pieces.into_iter().enumerate() {
        let start = if k == 0 { 0 } else { joins[k - 1].1 };
        let end = if k + 1 == n { p.ids.len() } else { joins[k].0 };
        if start > end {
            return Ok(None);
        }
        out.extend_from_slice(&p.ids[start..end]);
    }
    Ok(Some(out))
}

/// Where `left` (the piece before `cut`) ends and `right` starts: at the
/// first token from `cut` on that starts at the same byte in both, with
/// the `AGREE` tokens on each side of it alike in both.
fn join(left: &Piece, right: &Piece, cut: usize, margin: usize) -> Option<(usize, usize)> {
    let (l, r) = (&left.tail, &right.head);
    (0..l.len())
        .filter(|&a| l[a].0 >= cut && l[a].0 < cut + margin / 2)
        // The first token starting there (byte-fallback tokens of one
        // character share its offsets).
        .filter(|&a| a == 0 || l[a - 1].0 != l[a].0)
        .find_map(|a| {
            let b = r.partition_point(|t| t.0 < l[a].0);
            let alike = a >= AGREE
                && b >= AGREE
                && a + AGREE <= l.len()
                && b + AGREE <= r.len()
                && l[a - AGREE..a + AGREE] == r[b - AGREE..b + AGREE];
            alike.then_some((left.tail_at + a, b))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words of letters as tokens, whitespace runs as tokens: a
    /// tokenizer whose tokens at a piece's edge are cut short.
    fn words(text: &str) -> Result<Encoded, ()> {
        let mut ids = Vec::new();
        let mut offs = Vec::new();
        let b = text.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let alpha = b[i].is_ascii_alphabetic();
            let j = (i..b.len())
                .find(|&j| b[j].is_ascii_alphabetic() != alpha)
                .unwrap_or(b.len());
            let h = b[i..j]
                .iter()
                .fold(7u32, |h, &c| h.wrapping_mul(31).wrapping_add(c as u32));
            ids.push(h % 1000);
            offs.push((i, j));
            i = j;
        }
        Ok((ids, offs))
    }

    fn text() -> String {
        (0..3000)
            .map(|i| format!("word{} and  more{}\n", i * 7 % 13, i % 5))
            .collect::<String>()
            .replace(char::is_numeric, "x")
    }

    #[test]
    fn pieces_give_the_ids_of_the_whole() {
        let t = text();
        let whole = words(&t).unwrap().0;
        for (piece, margin) in [(1000, 300), (4096, 512), (777, 200), (t.len(), 100)] {
            let got = encode_in_pieces(&t, piece, margin, words).unwrap();
            assert_eq!(got.as_ref(), Some(&whole), "pieces of {piece}, margin {margin}");
        }
    }

    #[test]
    fn a_prefix_at_each_piece_start_is_joined_past() {
        // Like a SentencePiece normalizer, every encoded text gets a
        // leading token the whole text has only once.
        let prefixed = |s: &str| {
            let (mut ids, mut offs) = words(s)?;
            ids.insert(0, 999);
            offs.insert(0, (0, 0));
            Ok::<_, ()>((ids, offs))
        };
        let t = text();
        let whole = prefixed(&t).unwrap().0;
        let got = encode_in_pieces(&t, 1500, 400, prefixed).unwrap();
        assert_eq!(got, Some(whole));
    }

    fn corpus() -> String {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/data/tinyshakespeare.txt"
        );
        std::fs::read_to_string(p).expect("../shared/data/tinyshakespeare.txt beside the repository")
    }

    fn hf(t: &tokenizers::Tokenizer) -> impl Fn(&str) -> tokenizers::Result<Encoded> + Sync {
        move |s| {
            let e = t.encode(s, false)?;
            Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
        }
    }

    /// `text` in pieces of `piece` bytes (more than 200k ids in all, so
    /// there are joins) gives the ids of encoding it whole.
    fn assert_pieces_give_the_whole(t: &tokenizers::Tokenizer, text: &str, piece: usize) {
        let whole = t.encode(text, false).unwrap().get_ids().to_vec();
        assert!(whole.len() > 200_000 && text.len() > 8 * piece);
        let got = encode_in_pieces(text, piece, 4 << 10, hf(t)).unwrap();
        let len = got.as_ref().map_or(0, Vec::len);
        assert!(got == Some(whole), "{len} ids from the pieces");
    }

    #[test]
    fn a_byte_level_bpe_in_pieces_gives_the_whole_texts_ids() {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/tokenizer/tokenizer.json"
        );
        let t = tokenizers::Tokenizer::from_file(p).unwrap();
        assert_pieces_give_the_whole(&t, &corpus(), 64 << 10);
    }

    /// Llama's (SentencePiece) arrangement: "▁" prepended to the text and
    /// standing for spaces, no pre-tokenizer, so merges run over the whole
    /// text as one word and every piece starts with a "▁" of its own.
    #[test]
    fn a_sentencepiece_style_bpe_in_pieces_gives_the_whole_texts_ids() {
        let text: String = corpus().chars().take(300_000).collect();
        let mut chars: Vec<char> = text.chars().filter(|&c| c != ' ').collect();
        chars.extend(['▁', '?']);
        chars.sort_unstable();
        chars.dedup();
        let mut vocab: Vec<String> = chars.iter().map(char::to_string).collect();
        let merges = [
            ("▁", "t"),
            ("▁t", "h"),
            ("▁th", "e"),
            ("e", "r"),
            ("▁", "a"),
            ("o", "u"),
            ("i", "n"),
        ];
        vocab.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": "?", "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab.iter().enumerate().map(|(i, v)| (v.clone(), i.into())).collect::<serde_json::Map<_, _>>(),
                "merges": merges.iter().map(|(a, b)| [a, b]).collect::<Vec<_>>()}
        });
        let t: tokenizers::Tokenizer = json.to_string().parse().unwrap();
        assert_pieces_give_the_whole(&t, &text, 32 << 10);
    }

    #[test]
    fn pieces_that_never_agree_say_so() {
        // A token as long as the text: no join can be found.
        let t = "a".repeat(5000);
        assert_eq!(encode_in_pieces(&t, 1000, 200, words).unwrap(), None);
    }
}
