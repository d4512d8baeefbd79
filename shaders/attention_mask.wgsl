// Which keys a query row attends to, for every attention kernel (their
// Params all carry t and window): keys first_key(i) ..= i, the last
// `window` of them where window > 0 (the sliding window of Mistral and
// Phi-3, transformers' kv > q − window), all of them where it is 0. The host
// passes 0 for a window of T keys or more, so j + window stays below 2T.

fn first_key(i: u32) -> u32 {
    if p.window == 0u {
        return 0u;
    }
    return i + 1u - min(i + 1u, p.window);
}

// One past the last query that sees key j.
fn query_end(j: u32) -> u32 {
    if p.window == 0u {
        return p.t;
    }
    return min(p.t, j + p.window);
}

fn sees(i: u32, j: u32) -> bool {
    return j <= i && j >= first_key(i);
}
