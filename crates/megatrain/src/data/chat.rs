//! How an instruction record's messages become text, and which of it the
//! loss counts: fixed headers (the Stanford Alpaca prompt by default), or
//! the model's own Jinja chat template as Hugging Face tokenizers ship it
//! (`chat_template` of `tokenizer_config.json`, or `chat_template.jinja`),
//! rendered as transformers' `apply_chat_template` renders it.
//!
//! A template renders whole conversations, so the text of an assistant
//! turn is found by rendering prefixes of the conversation: the messages
//! before the turn with the generation prompt, then through the turn. The
//! turn's text (its content and the template's end-of-turn tokens) lies
//! between the two, and only it is counted. A template whose renderings of
//! a conversation are not prefixes of one another rewrites earlier turns by
//! what follows (Qwen3's drops the reasoning of the turns before the last
//! user message): then the conversation becomes one rendering per
//! assistant turn, the messages through it, as the template renders them
//! when that turn is the one generated, and only that turn is counted in
//! it, as transformers-based trainers split such conversations. A turn
//! even that cannot find is refused by line. The loader encodes each
//! rendering whole, as the model will see it, and counts the tokens that
//! start in counted text ([`super::TextEncoder::encode_with_offsets`]).

use std::path::PathBuf;

use minijinja::{Environment, Value, context};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant` (or another role a template knows).
    pub role: String,
    pub content: String,
}

/// Text placed around prompts and responses, `{text}` (and `{input}`)
/// standing for the record's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headers {
    pub system: String,
    pub user: String,
    pub user_with_input: String,
    pub assistant: String,
}

impl Default for Headers {
    fn default() -> Self {
        Headers {
            system: "{text}\n\n".into(),
            user: "### Instruction:\n{text}\n\n".into(),
            user_with_input: "### Instruction:\n{text}\n\n### Input:\n{input}\n\n".into(),
            assistant: "### Response:\n".into(),
        }
    }
}

/// A Jinja chat template with the token strings it refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JinjaTemplate {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
    /// Where the template was read (named in errors; not part of what
    /// decides the text).
    pub origin: PathBuf,
}

/// How `.jsonl` records become text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// Headers by role; each response is followed by the tokenizer's
    /// end-of-sequence id.
    Headers(Headers),
    /// The model's template; its own end-of-turn tokens end responses.
    Jinja(JinjaTemplate),
}

impl Default for ChatTemplate {
    /// The Stanford Alpaca headers.
    fn default() -> Self {
        ChatTemplate::Headers(Headers::default())
    }
}

impl ChatTemplate {
    /// What decides the text of a record, for naming cached ids.
    pub fn key_parts(&self) -> Vec<&str> {
        match self {
            ChatTemplate::Headers(h) => vec![&h.system, &h.user, &h.user_with_input, &h.assistant],
            ChatTemplate::Jinja(j) => vec!["jinja", &j.source, &j.bos_token, &j.eos_token],
        }
    }
}

impl ChatTemplate {
    /// The text that prompts a model to answer the last of `messages`: the
    /// template's rendering with its generation prompt, or the headers of
    /// the turns and the assistant's header.
    pub fn generation_prompt(&self, messages: &[Message]) -> Result<String, String> {
        let h = match self {
            ChatTemplate::Jinja(j) => return Renderer::new(j)?.render(messages, true),
            ChatTemplate::Headers(h) => h,
        };
        let text: String = h.pieces(messages)?.into_iter().map(|p| p.0).collect();
        Ok(text + &h.assistant)
    }
}

impl Headers {
    /// `messages` as pieces of text in order, each assistant reply counted
    /// (its header not).
    pub fn pieces(&self, messages: &[Message]) -> Result<Vec<Piece>, String> {
        let mut pieces = Vec::with_capacity(messages.len() + 1);
        for (k, m) in messages.iter().enumerate() {
            match m.role.as_str() {
                "system" => pieces.push((self.system.replace("{text}", &m.content), false)),
                "user" => pieces.push((self.user.replace("{text}", &m.content), false)),
                "assistant" => {
                    pieces.push((self.assistant.clone(), false));
                    pieces.push((m.content.clone(), true));
                }
                other => {
                    return Err(format!(
                        "turn {k}: unknown role '{other}' (the headers know system, human, user, gpt and \
                         assistant; a chat template may know it: --chat-template)"
                    ));
                }
            }
        }
        Ok(pieces)
    }
}

/// A compiled Jinja template, shared by the threads that render records.
pub struct Renderer {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

/// A piece of a rendered conversation and whether the loss counts it.
pub type Piece = (String, bool);

/// Assistant turn `k` of a conversation: the messages before it rendered
/// with the generation prompt, and the messages through it.
struct TurnText {
    k: usize,
    before: String,
    through: String,
}

impl Renderer {
    /// Compiles `t` in the environment transformers renders templates in
    /// ([`super::jinja`]).
    pub fn new(t: &JinjaTemplate) -> Result<Renderer, String> {
        let env = super::jinja::environment(t.source.clone())
            .map_err(|e| format!("{}: chat template: {e:#}", t.origin.display()))?;
        Ok(Renderer {
            env,
            bos: t.bos_token.clone(),
            eos: t.eos_token.clone(),
        })
    }

    fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => &m.role, content => &m.content })
            .collect();
        let ctx = context! {
            messages => msgs,
            bos_token => &self.bos,
            eos_token => &self.eos,
            add_generation_prompt => add_generation_prompt,
        };
        let t = self.env.get_template("chat").expect("added in new");
        t.render(ctx).map_err(|e| format!("chat template: {e:#}"))
    }

    /// The conversation as renderings of pieces of text in order, the
    /// assistant turns counted: one rendering where the template renders
    /// turns in order, else one per assistant turn (see the module's doc).
    pub fn renderings(&self, messages: &[Message]) -> Result<Vec<Vec<Piece>>, String> {
        let full = self.render(messages, false)?;
        let turns = self.turn_texts(messages)?;
        let whole = match self.cut_whole(&full, messages, &turns) {
            Ok(pieces) => return Ok(vec![pieces]),
            Err(e) => e,
        };
        if turns.len() < 2 {
            return Err(whole);
        }
        turns
            .iter()
            .map(|t| {
                // A reasoning template may lay out the think block its own
                // way: the answer after it must be there.
                let content = messages[t.k].content.as_str();
                let answer = content.rsplit("</think>").next().unwrap_or(content).trim();
                match t.through.strip_prefix(t.before.as_str()) {
                    Some(turn) if turn.contains(answer) => {
                        let mut p = vec![(t.before.clone(), false), (turn.to_string(), true)];
                        p.retain(|(text, _)| !text.is_empty());
                        Ok(p)
                    }
                    _ => Err(whole.clone()),
                }
            })
            .collect()
    }

    /// The whole-conversation cut alone, which the tests look at.
    #[cfg(test)]
    fn pieces(&self, messages: &[Message]) -> Result<Vec<Piece>, String> {
        let full = self.render(messages, false)?;
        self.cut_whole(&full, messages, &self.turn_texts(messages)?)
    }

    /// The two renderings around each assistant turn, which both ways of
    /// cutting a conversation read.
    fn turn_texts(&self, messages: &[Message]) -> Result<Vec<TurnText>, String> {
        (0..messages.len())
            .filter(|&k| messages[k].role == "assistant")
            .map(|k| {
                Ok(TurnText {
                    k,
                    before: self.render(&messages[..k], true)?,
                    through: self.render(&messages[..=k], false)?,
                })
            })
            .collect()
    }

    /// The conversation as one rendering's pieces of text in order, the
    /// assistant turns counted (see the module's doc), cut from the whole
    /// conversation's rendering and the turns'. A template may close a
    /// conversation that asks for no generation prompt with its
    /// `eos_token` (Phi-3's does): a turn's rendering may end with it where
    /// the whole conversation goes on, and it is counted only after the
    /// last turn, where it is in the text.
    fn cut_whole(&self, full: &str, messages: &[Message], turns: &[TurnText]) -> Result<Vec<Piece>, String> {
        let mut pieces = Vec::new();
        let mut at = 0;
        for TurnText { k, before, through } in turns {
            let (k, m) = (*k, &messages[*k]);
            let closed = through
                .strip_suffix(self.eos.as_str())
                .filter(|_| !self.eos.is_empty());
            let end = [Some(through.as_str()), closed]
                .into_iter()
                .flatten()
                .find(|t| full.starts_with(t))
                .map(str::len);
            let turn = end.and_then(|e| full.get(before.len()..e)).unwrap_or_default();
            if before.len() < at || !full.starts_with(before.as_str()) || !turn.contains(m.content.trim()) {
                return Err(format!(
                    "the chat template does not render messages[{k}] (assistant) as a continuation of \
                     the messages before it, even as the last turn, so its text cannot be told apart \
                     from theirs; use --chat-template alpaca, or a template file that renders turns in order"
                ));
            }
            pieces.push((full[at..before.len()].to_string(), false));
            pieces.push((turn.to_string(), true));
            at = before.len() + turn.len();
        }
        pieces.push((full[at..].to_string(), false));
        pieces.retain(|(text, _)| !text.is_empty());
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                          {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn renderer(source: &str) -> Renderer {
        Renderer::new(&JinjaTemplate {
            source: source.into(),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
            origin: "t.jinja".into(),
        })
        .unwrap()
    }

    #[test]
    fn assistant_turns_and_their_end_tokens_are_the_counted_pieces() {
        let r = renderer(CHATML);
        let conv = [
            msg("system", "Be brief."),
            msg("user", "Hi"),
            msg("assistant", "Hello!"),
            msg("user", "Bye"),
            msg("assistant", "Bye!"),
        ];
        let pieces = r.pieces(&conv).unwrap();
        let counted: Vec<&str> = pieces.iter().filter(|p| p.1).map(|p| p.0.as_str()).collect();
        assert_eq!(counted, ["Hello!<|im_end|>\n", "Bye!<|im_end|>\n"]);
        let whole: String = pieces.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(whole, r.render(&conv, false).unwrap());
        assert!(pieces[0].0.ends_with("<|im_start|>assistant\n") && !pieces[0].1);
    }

    #[test]
    fn text_written_only_at_the_end_is_counted_only_there() {
        // Phi-3's arrangement: eos_token closes a conversation that asks
        // for no generation prompt.
        let r = renderer(
            "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}",
        );
        let conv = [
            msg("user", "a"),
            msg("assistant", "b"),
            msg("user", "c"),
            msg("assistant", "d"),
        ];
        let counted: Vec<String> = r
            .pieces(&conv)
            .unwrap()
            .into_iter()
            .filter(|p| p.1)
            .map(|p| p.0)
            .collect();
        assert_eq!(counted, ["b<|end|>\n", "d<|end|>\n</s>"]);
    }

    #[test]
    fn a_generation_prompt_ends_where_the_reply_begins() {
        let conv = [msg("system", "S"), msg("user", "Hi")];
        let jinja = ChatTemplate::Jinja(JinjaTemplate {
            source: CHATML.into(),
            bos_token: String::new(),
            eos_token: String::new(),
            origin: "t".into(),
        });
        assert_eq!(
            jinja.generation_prompt(&conv).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let alpaca = ChatTemplate::default().generation_prompt(&conv).unwrap();
        assert_eq!(alpaca, "S\n\n### Instruction:\nHi\n\n### Response:\n");
        assert!(
            ChatTemplate::default()
                .generation_prompt(&[msg("tool", "x")])
                .is_err()
        );
    }

    #[test]
    fn a_template_that_rewrites_earlier_turns_renders_once_per_turn() {
        // Renders the last assistant turn differently from earlier ones.
        let r = renderer(
            "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]{% endif %}\
             {{ m.content }}|{% endfor %}",
        );
        let conv = [
            msg("user", "a"),
            msg("assistant", "b"),
            msg("user", "c"),
            msg("assistant", "d"),
        ];
        let err = r.pieces(&conv).unwrap_err();
        assert!(err.contains("messages[1]"), "{err}");
        let piece = |t: &str, c: bool| (t.to_string(), c);
        assert_eq!(
            r.renderings(&conv).unwrap(),
            [
                vec![piece("a|", false), piece("b|", true)],
                vec![piece("a|[old]b|c|", false), piece("d|", true)],
            ]
        );
        // A conversation rendered in order stays one rendering.
        let r = renderer(CHATML);
        assert_eq!(r.renderings(&conv).unwrap().len(), 1);
    }

    #[test]
    fn a_turn_not_even_rendered_after_its_prompt_is_refused() {
        // The generation prompt is not how the template opens a reply.
        let r = renderer(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
             {% if add_generation_prompt %}<reply>{% endif %}",
        );
        for conv in [
            vec![msg("user", "a"), msg("assistant", "b")],
            vec![
                msg("user", "a"),
                msg("assistant", "b"),
                msg("user", "c"),
                msg("assistant", "d"),
            ],
        ] {
            let err = r.renderings(&conv).unwrap_err();
            assert!(
                err.contains("messages[1]") && err.contains("--chat-template alpaca"),
                "{err}"
            );
        }
    }

    #[test]
    fn raise_exception_and_bad_syntax_are_errors() {
        let r = renderer("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}");
        let err = r.pieces(&[msg("assistant", "x")]).unwrap_err();
        assert!(err.contains("user first"), "{err}");
        let bad = Renderer::new(&JinjaTemplate {
            source: "{% for %}".into(),
            bos_token: String::new(),
            eos_token: String::new(),
            origin: "dir/tokenizer_config.json".into(),
        });
        let err = bad.err().unwrap();
        assert!(err.contains("dir/tokenizer_config.json: chat template"), "{err}");
    }
}
