//! Alertmanager label matchers, as `[gates.alertmanager] matchers` are
//! written (#36 item 4).
//!
//! Owns the matcher syntax (Alertmanager's and Prometheus's: `=`, `!=`,
//! `=~`, `!~`, regexes anchored at both ends, a missing label read as the
//! empty string): its parse, done while the config is read, and what a
//! matcher selects. It belongs to the config, below `observe::gate`, which
//! applies the matchers to the alerts it reads; it must never import
//! anything of the crate (it is the floor the config stands on).

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

/// How a matcher compares a label's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchOp {
    Equal,
    NotEqual,
    Regex,
    NotRegex,
}

impl MatchOp {
    fn as_str(self) -> &'static str {
        match self {
            MatchOp::Equal => "=",
            MatchOp::NotEqual => "!=",
            MatchOp::Regex => "=~",
            MatchOp::NotRegex => "!~",
        }
    }
}

/// One label matcher (`severity="critical"`, `alertname=~"Agent.*"`).
#[derive(Clone, Debug)]
pub struct Matcher {
    name: String,
    op: MatchOp,
    value: String,
    /// The value as a regex anchored at both ends (`=~`, `!~`).
    regex: Option<regex::Regex>,
}

impl PartialEq for Matcher {
    fn eq(&self, other: &Matcher) -> bool {
        self.name == other.name && self.op == other.op && self.value == other.value
    }
}

impl Matcher {
    /// Parses one matcher as Alertmanager writes them: a label name, an
    /// operator, and a value, double-quoted (with `\"`, `\\`, `\n`
    /// escapes) or bare.
    pub fn parse(text: &str) -> Result<Matcher, String> {
        let s = text.trim();
        let name_len = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        let (name, rest) = s.split_at(name_len);
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!(
                "matcher {text:?} does not start with a label name ([a-zA-Z_][a-zA-Z0-9_]*)"
            ));
        }
        let rest = rest.trim_start();
        let (op, rest) = [
            ("=~", MatchOp::Regex),
            ("!~", MatchOp::NotRegex),
            ("!=", MatchOp::NotEqual),
            ("=", MatchOp::Equal),
        ]
        .into_iter()
        .find_map(|(token, op)| rest.strip_prefix(token).map(|r| (op, r)))
        .ok_or_else(|| {
            format!("matcher {text:?} has no operator after {name:?} (one of = != =~ !~)")
        })?;
        let value = unquote(rest.trim())
            .ok_or_else(|| format!("matcher {text:?} has a badly quoted value"))?;
        let regex = match op {
            MatchOp::Regex | MatchOp::NotRegex => Some(
                regex::Regex::new(&format!("^(?:{value})$"))
                    .map_err(|e| format!("matcher {text:?} has an invalid regex: {e}"))?,
            ),
            MatchOp::Equal | MatchOp::NotEqual => None,
        };
        Ok(Matcher {
            name: name.to_owned(),
            op,
            value,
            regex,
        })
    }

    /// Whether an alert with `labels` matches (a missing label is "").
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let v = labels.get(&self.name).map_or("", String::as_str);
        match (self.op, &self.regex) {
            (MatchOp::Equal, _) => v == self.value,
            (MatchOp::NotEqual, _) => v != self.value,
            (MatchOp::Regex, Some(re)) => re.is_match(v),
            (MatchOp::NotRegex, Some(re)) => !re.is_match(v),
            // Built only by `parse`, which compiles every regex.
            (MatchOp::Regex | MatchOp::NotRegex, None) => false,
        }
    }
}

/// A value as written: `"…"` with escapes, or bare (no quote in it).
fn unquote(s: &str) -> Option<String> {
    let Some(inner) = s.strip_prefix('"') else {
        return (!s.contains('"')).then(|| s.to_owned());
    };
    let inner = inner.strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                c @ ('"' | '\\') => out.push(c),
                _ => return None,
            },
            '"' => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

impl fmt::Display for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{:?}", self.name, self.op.as_str(), self.value)
    }
}

impl<'de> Deserialize<'de> for Matcher {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Matcher::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn matchers_parse_as_alertmanager_writes_them() {
        let m = Matcher::parse(r#"severity="critical""#).unwrap();
        assert_eq!(m.to_string(), r#"severity="critical""#);
        assert_eq!(
            Matcher::parse(r#" alertname =~ "Agent.*" "#)
                .unwrap()
                .to_string(),
            r#"alertname=~"Agent.*""#
        );
        assert_eq!(
            Matcher::parse("env!=staging").unwrap().to_string(),
            r#"env!="staging""#
        );
        assert_eq!(
            Matcher::parse(r#"msg!~"a \"b\"""#).unwrap().to_string(),
            r#"msg!~"a \"b\"""#
        );
        for bad in [
            "",
            r#"="x""#,
            r#"1abc="x""#,
            r#"severity"critical""#,
            r#"severity=="critical""#,
            r#"severity="critical"#,
            r#"alertname=~"(""#,
            r#"a="x\q""#,
        ] {
            let e = Matcher::parse(bad).expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{e} names {bad:?}");
        }
    }

    #[test]
    fn matching_is_anchored_and_a_missing_label_is_empty() {
        let agent = labels(&[("alertname", "AgentErrorRate"), ("severity", "critical")]);
        let m = |s: &str| Matcher::parse(s).unwrap().matches(&agent);
        assert!(m(r#"alertname=~"Agent.*""#));
        assert!(!m(r#"alertname=~"Agent""#), "regexes are anchored");
        assert!(!m(r#"alertname=~"Error""#), "no substring match");
        assert!(m(r#"alertname!~"Error""#));
        assert!(m(r#"severity="critical""#));
        assert!(!m(r#"severity!="critical""#));
        assert!(m(r#"team="""#), "a missing label equals the empty string");
        assert!(m(r#"team!="x""#));
        assert!(m(r#"team=~".*""#));
        assert!(!m(r#"team=~".+""#));
        assert!(
            m(r#"alertname=~"Agent.*|Other""#),
            "alternation is anchored as a whole"
        );
        assert!(
            !Matcher::parse(r#"alertname=~"Other|Agent""#)
                .unwrap()
                .matches(&labels(&[("alertname", "AgentX")]))
        );
    }
}
