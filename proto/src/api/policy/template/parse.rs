//! The template language's parser: text and actions split by the dialect's delimiters,
//! tokens, and the tree of pipelines, commands and terms; and the checks of a parsed template
//! against what its dialect provides.

use serde_json::{Number, Value};

use super::{Dialect, HELPERS, MAX_TEMPLATE_BYTES, MAX_TEMPLATE_DEPTH};

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Node {
    Text(String),
    Action(Action),
    If {
        condition: Action,
        then: Vec<Node>,
        otherwise: Vec<Node>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub(super) struct Action {
    /// As written between the delimiters, for messages.
    pub(super) source: String,
    pub(super) pipeline: Pipeline,
}

#[derive(Clone, Debug, PartialEq)]
pub(super) struct Pipeline(pub(super) Vec<Command>);

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Command {
    Call { function: String, args: Vec<Term> },
    Term(Term),
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Term {
    /// `.A.B` (`.` itself when empty).
    Dot(Vec<String>),
    Literal(Value),
    /// `(pipeline).A.B`.
    Group(Box<Pipeline>, Vec<String>),
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Field(Vec<String>),
    Ident(String),
    Literal(Value),
    Pipe,
    Open,
    Close,
}

/// One action's tokens, each with whether whitespace preceded it.
type Tokens = Vec<(Token, bool)>;

enum Piece {
    Text(String),
    Action { source: String, tokens: Tokens },
}

pub(super) fn parse(text: &str, dialect: &Dialect) -> Result<Vec<Node>, String> {
    if text.len() > MAX_TEMPLATE_BYTES {
        return Err(format!(
            "the template takes {} bytes, more than the {MAX_TEMPLATE_BYTES} allowed",
            text.len()
        ));
    }
    let pieces = split(text, dialect)?;
    let mut pieces = pieces.into_iter();
    let (nodes, end) = parse_list(&mut pieces, 0, false)?;
    match end {
        ListEnd::Eof => Ok(nodes),
        ListEnd::Else(_) => Err("{{else}} outside an {{if}}".to_string()),
        ListEnd::End => Err("{{end}} outside an {{if}}".to_string()),
    }
}

/// Splits `text` into text and the actions' tokens, applying the trim markers and dropping
/// comments.
fn split(text: &str, dialect: &Dialect) -> Result<Vec<Piece>, String> {
    let (open, close) = (dialect.open(), dialect.close());
    let mut pieces = Vec::new();
    let mut rest = text;
    let mut trim_next = false;
    let mut literal = String::new();
    while let Some(at) = rest.find(open) {
        if *dialect == Dialect::Managed && rest[at..].starts_with("{{hub") {
            // The hub's template, left as written.
            let end = rest[at..]
                .find("hub}}")
                .map_or(rest.len(), |e| at + e + "hub}}".len());
            literal.push_str(&rest[..end]);
            rest = &rest[end..];
            continue;
        }
        let mut before = std::mem::take(&mut literal) + &rest[..at];
        if trim_next {
            before = before.trim_start().to_string();
        }
        let inside = &rest[at + open.len()..];
        let end = find_close(inside, close)
            .ok_or_else(|| format!("unclosed action: no {close} after {open}"))?;
        let mut body = &inside[..end];
        rest = &inside[end + close.len()..];
        if let Some(trimmed) = body.strip_prefix('-')
            && trimmed.starts_with(char::is_whitespace)
        {
            before = before.trim_end().to_string();
            body = trimmed;
        }
        trim_next = false;
        if let Some(trimmed) = body.strip_suffix('-')
            && trimmed.ends_with(char::is_whitespace)
        {
            trim_next = true;
            body = trimmed;
        }
        if !before.is_empty() {
            pieces.push(Piece::Text(before));
        }
        let body = body.trim();
        if body.starts_with("/*") {
            if !body.ends_with("*/") {
                return Err("unclosed comment".to_string());
            }
            continue;
        }
        pieces.push(Piece::Action {
            source: format!("{open} {body} {close}"),
            tokens: tokenize(body)?,
        });
    }
    let mut tail = literal + rest;
    if trim_next {
        tail = tail.trim_start().to_string();
    }
    if !tail.is_empty() {
        pieces.push(Piece::Text(tail));
    }
    Ok(pieces)
}

/// Where `close` ends the action, skipping quoted strings.
fn find_close(inside: &str, close: &str) -> Option<usize> {
    let bytes = inside.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'`' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'`' {
                    i += 1;
                }
            }
            // Bytes, not `&str`: `i` may fall inside a multi-byte character.
            _ if bytes[i..].starts_with(close.as_bytes()) => return Some(i),
            _ => {}
        }
        i += 1;
    }
    None
}

fn tokenize(body: &str) -> Result<Tokens, String> {
    let chars: Vec<char> = body.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    let mut spaced = true;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            spaced = true;
            i += 1;
            continue;
        }
        let token = match c {
            '|' => {
                i += 1;
                Token::Pipe
            }
            '(' => {
                i += 1;
                Token::Open
            }
            ')' => {
                i += 1;
                Token::Close
            }
            '.' => {
                let mut fields = Vec::new();
                while i < chars.len() && chars[i] == '.' {
                    let start = i + 1;
                    i = start;
                    while i < chars.len() && ident(chars[i]) {
                        i += 1;
                    }
                    let field: String = chars[start..i].iter().collect();
                    if field.is_empty() {
                        if !fields.is_empty() || (i < chars.len() && chars[i] == '.') {
                            return Err("a field name is missing after '.'".to_string());
                        }
                        break;
                    }
                    fields.push(field);
                }
                Token::Field(fields)
            }
            '"' => {
                let mut s = String::new();
                i += 1;
                loop {
                    let Some(&c) = chars.get(i) else {
                        return Err("unterminated string".to_string());
                    };
                    i += 1;
                    match c {
                        '"' => break,
                        '\\' => {
                            let escaped = chars.get(i).copied().unwrap_or_default();
                            i += 1;
                            s.push(match escaped {
                                'n' => '\n',
                                't' => '\t',
                                'r' => '\r',
                                '\\' => '\\',
                                '"' => '"',
                                other => {
                                    return Err(format!("unknown escape \\{other} in a string"));
                                }
                            });
                        }
                        c => s.push(c),
                    }
                }
                Token::Literal(Value::String(s))
            }
            '`' => {
                let start = i + 1;
                let Some(len) = chars[start..].iter().position(|&c| c == '`') else {
                    return Err("unterminated raw string".to_string());
                };
                i = start + len + 1;
                Token::Literal(Value::String(chars[start..start + len].iter().collect()))
            }
            '-' | '+' | '0'..='9' => {
                let start = i;
                i += 1;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
                let text: String = chars[start..i].iter().collect();
                Token::Literal(number(&text).ok_or_else(|| format!("bad number {text:?}"))?)
            }
            '$' => return Err("variables ($) are not supported".to_string()),
            c if ident(c) => {
                let start = i;
                while i < chars.len() && ident(chars[i]) {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                match word.as_str() {
                    "true" => Token::Literal(Value::Bool(true)),
                    "false" => Token::Literal(Value::Bool(false)),
                    "nil" => Token::Literal(Value::Null),
                    _ => Token::Ident(word),
                }
            }
            other => return Err(format!("unexpected {other:?}")),
        };
        tokens.push((token, spaced));
        spaced = false;
    }
    Ok(tokens)
}

fn number(text: &str) -> Option<Value> {
    if let Ok(i) = text.parse::<i64>() {
        return Some(Value::Number(i.into()));
    }
    text.parse::<f64>()
        .ok()
        .and_then(Number::from_f64)
        .map(Value::Number)
}

/// How a list of nodes ended.
enum ListEnd {
    Eof,
    /// `{{else}}`, or `{{else if COND}}` with its condition.
    Else(Option<Action>),
    End,
}

const UNSUPPORTED_KEYWORDS: &[&str] = &[
    "range", "with", "define", "template", "block", "break", "continue",
];

fn parse_list(
    pieces: &mut std::vec::IntoIter<Piece>,
    depth: usize,
    in_if: bool,
) -> Result<(Vec<Node>, ListEnd), String> {
    let mut nodes = Vec::new();
    while let Some(piece) = pieces.next() {
        let (source, tokens) = match piece {
            Piece::Text(text) => {
                nodes.push(Node::Text(text));
                continue;
            }
            Piece::Action { source, tokens } => (source, tokens),
        };
        let keyword = match tokens.first() {
            Some((Token::Ident(word), _)) => word.as_str(),
            None => return Err("empty action".to_string()),
            _ => "",
        };
        match keyword {
            "if" => {
                let condition = action(&source, &tokens[1..], depth)?;
                nodes.push(parse_if(condition, pieces, depth + 1)?);
            }
            "else" | "end" if !in_if => {
                return Err(format!("{{{{{keyword}}}}} outside an {{{{if}}}}"));
            }
            "end" if tokens.len() == 1 => return Ok((nodes, ListEnd::End)),
            "else" if tokens.len() == 1 => return Ok((nodes, ListEnd::Else(None))),
            "else" if matches!(&tokens[1].0, Token::Ident(w) if w == "if") => {
                let condition = action(&source, &tokens[2..], depth)?;
                return Ok((nodes, ListEnd::Else(Some(condition))));
            }
            "else" | "end" => return Err(format!("unexpected words after {keyword}")),
            word if UNSUPPORTED_KEYWORDS.contains(&word) => {
                return Err(format!("{{{{{word}}}}} is not supported"));
            }
            _ => nodes.push(Node::Action(action(&source, &tokens, depth)?)),
        }
    }
    Ok((nodes, ListEnd::Eof))
}

fn parse_if(
    condition: Action,
    pieces: &mut std::vec::IntoIter<Piece>,
    depth: usize,
) -> Result<Node, String> {
    if depth > MAX_TEMPLATE_DEPTH {
        return Err(format!(
            "the template nests deeper than {MAX_TEMPLATE_DEPTH} levels"
        ));
    }
    let (then, end) = parse_list(pieces, depth, true)?;
    let otherwise = match end {
        ListEnd::End => Vec::new(),
        ListEnd::Else(None) => match parse_list(pieces, depth, true)? {
            (otherwise, ListEnd::End) => otherwise,
            (_, ListEnd::Else(_)) => return Err("{{else}} after {{else}}".to_string()),
            (_, ListEnd::Eof) => return Err("{{if}} without {{end}}".to_string()),
        },
        ListEnd::Else(Some(next)) => vec![parse_if(next, pieces, depth + 1)?],
        ListEnd::Eof => return Err("{{if}} without {{end}}".to_string()),
    };
    Ok(Node::If {
        condition,
        then,
        otherwise,
    })
}

fn action(source: &str, tokens: &[(Token, bool)], depth: usize) -> Result<Action, String> {
    if tokens.is_empty() {
        return Err("missing value".to_string());
    }
    let mut at = 0;
    let pipeline = pipeline(tokens, &mut at, depth)?;
    if at < tokens.len() {
        return Err(format!("unexpected {:?}", tokens[at].0));
    }
    Ok(Action {
        source: source.to_string(),
        pipeline,
    })
}

fn pipeline(tokens: &[(Token, bool)], at: &mut usize, depth: usize) -> Result<Pipeline, String> {
    if depth > MAX_TEMPLATE_DEPTH {
        return Err(format!(
            "the template nests deeper than {MAX_TEMPLATE_DEPTH} levels"
        ));
    }
    let mut commands = Vec::new();
    loop {
        commands.push(command(tokens, at, depth)?);
        match tokens.get(*at) {
            Some((Token::Pipe, _)) => *at += 1,
            _ => return Ok(Pipeline(commands)),
        }
    }
}

fn command(tokens: &[(Token, bool)], at: &mut usize, depth: usize) -> Result<Command, String> {
    if let Some((Token::Ident(function), _)) = tokens.get(*at) {
        *at += 1;
        let mut args = Vec::new();
        while let Some((token, _)) = tokens.get(*at) {
            if matches!(token, Token::Pipe | Token::Close) {
                break;
            }
            args.push(term(tokens, at, depth)?);
        }
        return Ok(Command::Call {
            function: function.clone(),
            args,
        });
    }
    let term = term(tokens, at, depth)?;
    match tokens.get(*at) {
        None | Some((Token::Pipe | Token::Close, _)) => Ok(Command::Term(term)),
        Some((token, _)) => Err(format!("{token:?} follows a value that is not a function")),
    }
}

fn term(tokens: &[(Token, bool)], at: &mut usize, depth: usize) -> Result<Term, String> {
    let Some((token, _)) = tokens.get(*at) else {
        return Err("missing value".to_string());
    };
    *at += 1;
    match token {
        Token::Field(fields) => Ok(Term::Dot(fields.clone())),
        Token::Literal(value) => Ok(Term::Literal(value.clone())),
        Token::Ident(word) => Err(format!(
            "{word} is used as an argument; call it in parentheses: ({word} ...)"
        )),
        Token::Open => {
            let inner = pipeline(tokens, at, depth + 1)?;
            if !matches!(tokens.get(*at), Some((Token::Close, _))) {
                return Err("unclosed '('".to_string());
            }
            *at += 1;
            let fields = match tokens.get(*at) {
                Some((Token::Field(fields), false)) => {
                    *at += 1;
                    fields.clone()
                }
                _ => Vec::new(),
            };
            Ok(Term::Group(Box::new(inner), fields))
        }
        Token::Pipe | Token::Close => Err(format!("unexpected {token:?}")),
    }
}

/// What [`check`] refuses in parsed templates: functions and fields outside the dialect, and a
/// hub `fromConfigMap` naming another namespace.
pub(super) fn check_nodes(nodes: &[Node], dialect: &Dialect) -> Result<(), String> {
    for node in nodes {
        match node {
            Node::Text(_) => {}
            Node::Action(action) => check_pipeline(&action.pipeline, dialect)?,
            Node::If {
                condition,
                then,
                otherwise,
            } => {
                check_pipeline(&condition.pipeline, dialect)?;
                check_nodes(then, dialect)?;
                check_nodes(otherwise, dialect)?;
            }
        }
    }
    Ok(())
}

fn check_pipeline(pipeline: &Pipeline, dialect: &Dialect) -> Result<(), String> {
    for command in &pipeline.0 {
        match command {
            Command::Call { function, args } => {
                if !HELPERS.contains(&function.as_str())
                    && !dialect.readers().contains(&function.as_str())
                {
                    return Err(format!(
                        "uses the function {function:?}, which flotilla's {} templates do not provide (they provide {} and {})",
                        dialect.name(),
                        dialect.readers().join(", "),
                        HELPERS.join(", ")
                    ));
                }
                if let Dialect::Hub { policy_namespace } = dialect
                    && function == "fromConfigMap"
                    && let Some(Term::Literal(Value::String(namespace))) = args.first()
                    && !namespace.is_empty()
                    && namespace != policy_namespace
                {
                    return Err(format!(
                        "reads the ConfigMap namespace {namespace:?}; hub templates read only the policy's namespace {policy_namespace:?} (write \"\" for it)"
                    ));
                }
                for arg in args {
                    check_term(arg, dialect)?;
                }
            }
            Command::Term(term) => check_term(term, dialect)?,
        }
    }
    Ok(())
}

fn check_term(term: &Term, dialect: &Dialect) -> Result<(), String> {
    match term {
        Term::Dot(fields) => match fields.first() {
            Some(field) if !dialect.fields().contains(&field.as_str()) => {
                Err(if dialect.fields().is_empty() {
                    format!(
                        "names .{field}; {} templates have no fields",
                        dialect.name()
                    )
                } else {
                    format!(
                        "names .{field}; {} templates have only .{}",
                        dialect.name(),
                        dialect.fields().join(" and .")
                    )
                })
            }
            _ => Ok(()),
        },
        Term::Literal(_) => Ok(()),
        Term::Group(inner, _) => check_pipeline(inner, dialect),
    }
}

pub(super) fn nodes_call(nodes: &[Node], function: &str) -> bool {
    nodes.iter().any(|node| match node {
        Node::Text(_) => false,
        Node::Action(action) => pipeline_calls(&action.pipeline, function),
        Node::If {
            condition,
            then,
            otherwise,
        } => {
            pipeline_calls(&condition.pipeline, function)
                || nodes_call(then, function)
                || nodes_call(otherwise, function)
        }
    })
}

fn pipeline_calls(pipeline: &Pipeline, function: &str) -> bool {
    let term_calls =
        |term: &Term| matches!(term, Term::Group(inner, _) if pipeline_calls(inner, function));
    pipeline.0.iter().any(|command| match command {
        Command::Call {
            function: called,
            args,
        } => called == function || args.iter().any(term_calls),
        Command::Term(term) => term_calls(term),
    })
}
