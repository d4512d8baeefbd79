// Which keys a query row attends to, and which of their probabilities a
// dropout keeps, for every attention kernel (their Params all carry t, hq,
// window, docs, docs_off, docs_ends and the drop_ fields): keys
// first_key(b, i) ..= i of row b of the dispatch's batch chunk, the last
// `window` of them where window > 0 (the sliding window of Mistral and
// Phi-3, transformers' kv > q − window), all of them where it is 0. The host
// passes 0 for a window of T keys or more, so j + window stays below 2T.
//
// With documents packed in the rows (docs != 0: megatrain_tensor's Docs)
// only the keys of the query's own document as well. DOCS holds
// Docs::bounds(): the first position of token i's document at docs_off +
// b·T + i (docs_off counts the chunk's first row), one past its last
// docs_ends further on. Both are nondecreasing along a row, and so are
// first_key and query_end, which is what the kernels' tile bounds rest on:
// the first key of a block's first row is at or before every row's, the
// query end of a block's last key at or past every key's, so tiles wholly
// before a block's first document, or past its last, are never loaded.
// Where docs is 0 DOCS is a dummy binding that nothing reads.

@group(0) @binding(13) var<storage, read> DOCS: array<u32>;

// Token i's document's first position (`at` 0) or one past its last (`at`
// docs_ends). Positions past T (the rows and keys of a ragged last block,
// which store nothing) read the last token's, so that no read leaves the row.
fn doc_bound(b: u32, i: u32, at: u32) -> u32 {
    return DOCS[p.docs_off + at + b * p.t + min(i, p.t - 1u)];
}

fn first_key(b: u32, i: u32) -> u32 {
    var k = 0u;
    if p.window != 0u {
        k = i + 1u - min(i + 1u, p.window);
    }
    if p.docs != 0u {
        k = max(k, doc_bound(b, i, 0u));
    }
    return k;
}

// One past the last query that sees key j.
fn query_end(b: u32, j: u32) -> u32 {
    var e = p.t;
    if p.window != 0u {
        e = min(p.t, j + p.window);
    }
    if p.docs != 0u {
        e = min(e, doc_bound(b, j, p.docs_ends));
    }
    return e;
}

fn sees(b: u32, i: u32, j: u32) -> bool {
    return j <= i && j >= first_key(b, i);
}

// Dropout of the probabilities (megatrain_tensor's AttnMask::dropout;
// dropout_mask.wgsl goes before this file): the factor key j's
// probability in query row i of head h takes, 0 or 1 / (1 − p), and 1
// where drop_threshold is 0 (a branch on a uniform). Mask rows count
// (batch row, head, query) from drop_batch0, which the host sets to the
// dispatch's first batch row in the whole batch.
fn drop_factor(b: u32, h: u32, i: u32, j: u32) -> f32 {
    if p.drop_threshold == 0u {
        return 1.0;
    }
    let row = ((p.drop_batch0 + b) * p.hq + h) * p.t + i;
    return select(0.0, p.drop_scale, dropout_keeps(p.drop_key0, p.drop_key1, p.drop_threshold, row, j));
}
