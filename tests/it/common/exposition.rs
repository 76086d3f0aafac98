//! A strict checker of the Prometheus text exposition format (0.0.4), so
//! `cargo test` judges every scrape with nothing installed; CI also runs
//! `promtool check metrics` on the scrapes the tests save.
//!
//! It rejects what Prometheus would refuse to ingest (bad names, label
//! syntax or escapes, values, a family's samples split up, a series twice,
//! metadata after samples or twice) and what `promtool check metrics` lints
//! as a problem (no HELP, a counter without `_total`, a histogram without
//! its `+Inf` bucket, `_sum` or `_count`, or with buckets that decrease).

use std::collections::{BTreeMap, HashMap, HashSet};

/// One sample line, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

#[derive(Debug, Default)]
struct Family {
    help: bool,
    kind: Option<String>,
    samples: Vec<Sample>,
}

/// Checks `text`; the error names the line and what is wrong with it.
pub fn check(text: &str) -> Result<Vec<Sample>, String> {
    let mut families: Vec<(String, Family)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut series: HashSet<(String, BTreeMap<String, String>)> = HashSet::new();
    let mut all = Vec::new();
    if !text.is_empty() && !text.ends_with('\n') {
        return Err("the exposition does not end with a newline".into());
    }
    for (n, line) in text.lines().enumerate() {
        let at = |msg: String| format!("line {}: {msg}: {line:?}", n + 1);
        if line.is_empty() {
            continue;
        }
        let family_name;
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (keyword, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let arg = parts.next();
            if keyword != "HELP" && keyword != "TYPE" {
                continue; // a plain comment
            }
            if !valid_metric_name(name) {
                return Err(at(format!("invalid metric name {name:?}")));
            }
            family_name = name.to_string();
            let i = family_index(&mut families, &mut index, &family_name);
            let family = &mut families[i].1;
            if !family.samples.is_empty() {
                return Err(at(format!("{keyword} after the samples of {name}")));
            }
            match keyword {
                "HELP" => {
                    if std::mem::replace(&mut family.help, true) {
                        return Err(at(format!("a second HELP for {name}")));
                    }
                    unescape(arg.unwrap_or(""), false).map_err(&at)?;
                }
                _ => {
                    let kind = arg.unwrap_or("");
                    if !matches!(
                        kind,
                        "counter" | "gauge" | "histogram" | "summary" | "untyped"
                    ) {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if family.kind.replace(kind.to_string()).is_some() {
                        return Err(at(format!("a second TYPE for {name}")));
                    }
                }
            }
        } else if line.starts_with('#') {
            continue;
        } else {
            let sample = parse_sample(line).map_err(&at)?;
            family_name = family_of(&families, &index, &sample.name);
            let i = family_index(&mut families, &mut index, &family_name);
            if !series.insert((sample.name.clone(), sample.labels.clone())) {
                return Err(at("the same series twice".into()));
            }
            families[i].1.samples.push(sample.clone());
            all.push(sample);
        }
        // A family's lines are contiguous.
        if current.as_deref() != Some(family_name.as_str()) {
            if closed.contains(&family_name) {
                return Err(at(format!("the lines of {family_name} are split up")));
            }
            if let Some(previous) = current.replace(family_name) {
                closed.insert(previous);
            }
        }
    }
    for (name, family) in &families {
        check_family(name, family)?;
    }
    Ok(all)
}

fn family_index(
    families: &mut Vec<(String, Family)>,
    index: &mut HashMap<String, usize>,
    name: &str,
) -> usize {
    *index.entry(name.to_string()).or_insert_with(|| {
        families.push((name.to_string(), Family::default()));
        families.len() - 1
    })
}

/// The family a sample belongs to: a histogram's or summary's `_bucket`,
/// `_sum` and `_count` belong to the declared base name.
fn family_of(families: &[(String, Family)], index: &HashMap<String, usize>, name: &str) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && let Some(i) = index.get(base)
            && matches!(
                families[*i].1.kind.as_deref(),
                Some("histogram" | "summary")
            )
        {
            return base.to_string();
        }
    }
    name.to_string()
}

fn check_family(name: &str, family: &Family) -> Result<(), String> {
    if !family.help {
        return Err(format!("{name}: no HELP"));
    }
    match family.kind.as_deref() {
        None => Err(format!("{name}: no TYPE")),
        Some("counter") if !name.ends_with("_total") => {
            Err(format!("{name}: a counter's name should end in _total"))
        }
        Some("counter") => match family
            .samples
            .iter()
            .find(|s| s.value < 0.0 || s.value.is_nan())
        {
            Some(s) => Err(format!("{name}: counter value {} is not a count", s.value)),
            None => Ok(()),
        },
        Some("histogram") => check_histogram(name, family),
        _ => Ok(()),
    }
}

fn check_histogram(name: &str, family: &Family) -> Result<(), String> {
    // Per label set (without `le`): its buckets in order, sum and count.
    type Key = BTreeMap<String, String>;
    let mut buckets: BTreeMap<Key, Vec<(f64, f64)>> = BTreeMap::new();
    let mut sums: HashSet<Key> = HashSet::new();
    let mut counts: HashMap<Key, f64> = HashMap::new();
    for s in &family.samples {
        let mut key = s.labels.clone();
        if s.name == format!("{name}_bucket") {
            let le = key
                .remove("le")
                .ok_or_else(|| format!("{name}: a bucket without le"))?;
            let bound = parse_value(&le).map_err(|e| format!("{name}: le {le:?}: {e}"))?;
            buckets.entry(key).or_default().push((bound, s.value));
        } else if s.name == format!("{name}_sum") {
            sums.insert(key);
        } else if s.name == format!("{name}_count") {
            counts.insert(key, s.value);
        } else {
            return Err(format!(
                "{name}: unexpected sample {} in a histogram",
                s.name
            ));
        }
    }
    for (key, list) in &buckets {
        let mut last = (f64::NEG_INFINITY, 0.0);
        for (bound, count) in list {
            if *bound <= last.0 {
                return Err(format!("{name}{key:?}: bucket bounds not increasing"));
            }
            if *count < last.1 {
                return Err(format!("{name}{key:?}: bucket counts decrease"));
            }
            last = (*bound, *count);
        }
        if last.0 != f64::INFINITY {
            return Err(format!("{name}{key:?}: no +Inf bucket"));
        }
        if !sums.contains(key) {
            return Err(format!("{name}{key:?}: no _sum"));
        }
        match counts.get(key) {
            Some(count) if *count == last.1 => {}
            Some(count) => {
                return Err(format!(
                    "{name}{key:?}: _count {count} differs from the +Inf bucket {}",
                    last.1
                ));
            }
            None => return Err(format!("{name}{key:?}: no _count")),
        }
    }
    Ok(())
}

fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__")
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `\\`, `\n` and (in label values) `\"` are the only escapes.
fn unescape(s: &str, quoted: bool) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('\\') => out.push('\\'),
                Some('n') => out.push('\n'),
                Some('"') if quoted => out.push('"'),
                other => return Err(format!("invalid escape \\{}", other.unwrap_or(' '))),
            },
            '"' if quoted => return Err("unescaped quote".into()),
            '\n' => return Err("raw newline".into()),
            c => out.push(c),
        }
    }
    Ok(out)
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s
            .parse::<f64>()
            .map_err(|_| format!("{s:?} is not a number")),
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    if !valid_metric_name(name) {
        return Err(format!("invalid metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut body = body;
        loop {
            if let Some(after) = body.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = body.find('=').ok_or("a label without =")?;
            let label = &body[..eq];
            if !valid_label_name(label) {
                return Err(format!("invalid label name {label:?}"));
            }
            let value_start = body[eq + 1..]
                .strip_prefix('"')
                .ok_or("a label value without quotes")?;
            // The closing quote is the first one not escaped.
            let mut end = None;
            let mut escaped = false;
            for (i, c) in value_start.char_indices() {
                match c {
                    '\\' if !escaped => escaped = true,
                    '"' if !escaped => {
                        end = Some(i);
                        break;
                    }
                    _ => escaped = false,
                }
            }
            let end = end.ok_or("an unterminated label value")?;
            let value = unescape(&value_start[..end], true)?;
            if labels.insert(label.to_string(), value).is_some() {
                return Err(format!("label {label} twice"));
            }
            body = &value_start[end + 1..];
            if let Some(after) = body.strip_prefix(',') {
                body = after;
            } else if !body.starts_with('}') {
                return Err("labels not separated by commas".into());
            }
        }
    }
    let rest = rest.strip_prefix(' ').ok_or("no space before the value")?;
    let mut fields = rest.split(' ');
    let value = parse_value(fields.next().unwrap_or(""))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("trailing fields".into());
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}
