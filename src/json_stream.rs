//! A JSON array read as it arrives: each element is handed over as soon as
//! its last byte is in, and only the element being read is held, so memory
//! is bounded by the largest element, not by the whole answer.
//!
//! Owns only the splitting: it tracks strings, escapes and nesting to find
//! where each top-level element ends, and checks that what surrounds them is
//! a well-formed array (whitespace, commas, one `]`, nothing after). It must
//! never decode an element (the caller does, with serde) and never hold more
//! than `limit` bytes of one: a longer element fails as soon as it passes
//! the limit, naming the `"id"` it began with when it has one.

/// Why an array could not be split.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("expected a JSON array, found {found:?} at byte {at}")]
    NotAnArray { found: char, at: u64 },
    #[error("expected an object as element {index} of the array, found {found:?}")]
    NotAnObject { index: usize, found: char },
    #[error("element {index}{} is larger than {limit} bytes", id_suffix(.id))]
    TooLarge {
        index: usize,
        /// The element's `"id"`, when its first bytes carry one.
        id: Option<String>,
        limit: usize,
    },
    #[error("unexpected {found:?} after the end of the array at byte {at}")]
    TrailingData { found: char, at: u64 },
    #[error("expected ',' or ']' after element {index}, found {found:?}")]
    MissingComma { index: usize, found: char },
    #[error("the answer ended inside the array (after {elements} elements)")]
    Truncated { elements: usize },
}

fn id_suffix(id: &Option<String>) -> String {
    id.as_deref()
        .map(|id| format!(" (id {id})"))
        .unwrap_or_default()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Where {
    /// Before the opening `[`.
    Before,
    /// Inside the array, where an element or `]` may come (after `[`).
    First,
    /// Inside the array, after an element: `,` or `]`.
    AfterElement,
    /// After a `,`: an element must come.
    AfterComma,
    /// Inside an element.
    InElement,
    /// After the closing `]`.
    Done,
}

/// Splits one JSON array of objects fed in chunks of any size.
#[derive(Debug)]
pub struct ArraySplitter {
    limit: usize,
    at: Where,
    /// Nesting inside the current element (1 once its `{` is read).
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The current element's bytes so far.
    element: Vec<u8>,
    /// Elements handed over.
    elements: usize,
    /// Bytes fed, for error positions.
    offset: u64,
}

impl ArraySplitter {
    /// `limit`: the most bytes one element may have.
    pub fn new(limit: usize) -> ArraySplitter {
        ArraySplitter {
            limit,
            at: Where::Before,
            depth: 0,
            in_string: false,
            escaped: false,
            element: Vec::new(),
            elements: 0,
            offset: 0,
        }
    }

    /// Elements handed over so far.
    pub fn elements(&self) -> usize {
        self.elements
    }

    /// Feeds the next chunk; `each` gets every element completed in it,
    /// in order. An error from `each` stops the split and is returned.
    pub fn push<E: From<SplitError>>(
        &mut self,
        chunk: &[u8],
        each: &mut impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut i = 0;
        while i < chunk.len() {
            if self.at == Where::InElement {
                // Scan to the element's end (or the chunk's), then copy once.
                let (next, ended) = self.scan_element(chunk, i);
                self.take_piece(&chunk[i..next], ended, each)?;
                i = next;
                continue;
            }
            let b = chunk[i];
            let at = self.offset + i as u64;
            i += 1;
            if b.is_ascii_whitespace() {
                continue;
            }
            self.at = self.between_elements(b, at)?;
        }
        self.offset += chunk.len() as u64;
        Ok(())
    }

    /// Inside an element: steps through `chunk` from `i`, tracking strings,
    /// escapes and nesting, up to the byte after the element's closing
    /// bracket or the chunk's end; returns that position and whether the
    /// element ended. Nothing is copied here, so the caller copies once.
    #[inline]
    fn scan_element(&mut self, chunk: &[u8], mut i: usize) -> (usize, bool) {
        while i < chunk.len() {
            if self.in_string && !self.escaped {
                // Most of a machine's bytes are inside strings: jump
                // to the next quote or backslash instead of stepping
                // through the state machine byte by byte.
                match chunk[i..].iter().position(|&b| b == b'"' || b == b'\\') {
                    Some(skip) => i += skip,
                    None => return (chunk.len(), false),
                }
            }
            let b = chunk[i];
            i += 1;
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
            } else {
                match b {
                    b'"' => self.in_string = true,
                    b'{' | b'[' => self.depth += 1,
                    b'}' | b']' => {
                        self.depth = self.depth.saturating_sub(1);
                        if self.depth == 0 {
                            return (i, true);
                        }
                    }
                    _ => {}
                }
            }
        }
        (i, false)
    }

    /// Appends the scanned `piece` to the current element within the limit,
    /// and hands the element over when `ended`.
    #[inline]
    fn take_piece<E: From<SplitError>>(
        &mut self,
        piece: &[u8],
        ended: bool,
        each: &mut impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.element.len() + piece.len() > self.limit {
            let room = self.limit.saturating_sub(self.element.len());
            self.element
                .extend_from_slice(&piece[..room.min(piece.len())]);
            return Err(SplitError::TooLarge {
                index: self.elements,
                id: leading_id(&self.element),
                limit: self.limit,
            }
            .into());
        }
        self.element.extend_from_slice(piece);
        if ended {
            let done = each(&self.element);
            self.elements += 1;
            self.element.clear();
            // A huge element's buffer is not kept for the rest.
            if self.element.capacity() > 64 << 10 {
                self.element.shrink_to(64 << 10);
            }
            self.at = Where::AfterElement;
            done?;
        }
        Ok(())
    }

    /// Outside elements: where the non-whitespace byte `b` (at byte `at` of
    /// the whole answer) leads, or why it breaks the array's shape.
    #[inline]
    fn between_elements(&mut self, b: u8, at: u64) -> Result<Where, SplitError> {
        let found = char::from(b);
        Ok(match (self.at, b) {
            (Where::Before, b'[') => Where::First,
            (Where::Before, _) => return Err(SplitError::NotAnArray { found, at }),
            (Where::First | Where::AfterElement, b']') => Where::Done,
            (Where::AfterElement, b',') => Where::AfterComma,
            (Where::AfterElement, _) => {
                return Err(SplitError::MissingComma {
                    index: self.elements.saturating_sub(1),
                    found,
                });
            }
            (Where::First | Where::AfterComma, b'{') => {
                self.depth = 1;
                self.element.push(b);
                Where::InElement
            }
            (Where::First | Where::AfterComma, _) => {
                return Err(SplitError::NotAnObject {
                    index: self.elements,
                    found,
                });
            }
            (Where::Done, _) => return Err(SplitError::TrailingData { found, at }),
            (Where::InElement, _) => unreachable!("push scans elements itself"),
        })
    }

    /// After the last chunk: the array must have ended.
    pub fn finish(&self) -> Result<(), SplitError> {
        if self.at == Where::Done {
            Ok(())
        } else {
            Err(SplitError::Truncated {
                elements: self.elements,
            })
        }
    }
}

/// The `"id"` an object's first bytes carry (`{"id":"…"`), bounded and
/// printable, to name an element too large or malformed to decode.
pub fn leading_id(prefix: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(&prefix[..prefix.len().min(4096)]);
    let after = text.split_once("\"id\"")?.1.trim_start();
    let value = after.strip_prefix(':')?.trim_start().strip_prefix('"')?;
    let id: String = value
        .chars()
        .take_while(|c| *c != '"')
        .take(64)
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    (!id.is_empty()).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]], limit: usize) -> Result<Vec<String>, SplitError> {
        let mut s = ArraySplitter::new(limit);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut |e: &[u8]| {
                out.push(String::from_utf8_lossy(e).into_owned());
                Ok::<(), SplitError>(())
            })?;
        }
        s.finish()?;
        Ok(out)
    }

    /// Strings are skipped to their next quote or backslash: an escaped
    /// backslash before the closing quote, and brackets inside strings,
    /// must not end (or fail to end) an element, wherever the chunks cut.
    #[test]
    fn strings_are_skipped_whole_wherever_the_chunks_cut() {
        let text = br#"[{"id":"x","s":"a\\","t":"}{\"][","u":"\\\""},{"id":"y"}]"#;
        let want = [
            r#"{"id":"x","s":"a\\","t":"}{\"][","u":"\\\""}"#,
            r#"{"id":"y"}"#,
        ];
        assert_eq!(split(&[text], 1 << 10).unwrap(), want);
        for cut in 0..text.len() {
            for second in cut..text.len() {
                let chunks = [&text[..cut], &text[cut..second], &text[second..]];
                assert_eq!(
                    split(&chunks, 1 << 10).unwrap(),
                    want,
                    "cuts at {cut}, {second}"
                );
            }
        }
    }

    #[test]
    fn elements_come_out_whole_whatever_the_chunks() {
        let text = br#" [ {"id":"a","s":"}]\"{[","n":[1,{"x":2}]} , {"id":"b"}
        ] "#;
        let whole = split(&[text], 1 << 10).unwrap();
        assert_eq!(
            whole,
            [
                r#"{"id":"a","s":"}]\"{[","n":[1,{"x":2}]}"#,
                r#"{"id":"b"}"#
            ]
        );
        // Byte by byte, and cut at every position.
        let bytes: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(split(&bytes, 1 << 10).unwrap(), whole);
        for cut in 0..text.len() {
            let (a, b) = text.split_at(cut);
            assert_eq!(split(&[a, b], 1 << 10).unwrap(), whole, "cut at {cut}");
        }
        assert!(split(&[b"[]"], 8).unwrap().is_empty());
    }

    #[test]
    fn a_malformed_array_is_named() {
        let e = |t: &[u8]| split(&[t], 1 << 10).unwrap_err();
        assert!(matches!(
            e(b"{}"),
            SplitError::NotAnArray { found: '{', at: 0 }
        ));
        assert!(matches!(
            e(b"[1]"),
            SplitError::NotAnObject { index: 0, .. }
        ));
        assert!(matches!(
            e(b"[{}, 2]"),
            SplitError::NotAnObject { index: 1, .. }
        ));
        assert!(matches!(
            e(b"[{},]"),
            SplitError::NotAnObject {
                index: 1,
                found: ']'
            }
        ));
        assert!(matches!(
            e(b"[{} {}]"),
            SplitError::MissingComma { index: 0, .. }
        ));
        assert!(matches!(
            e(b"[{}] x"),
            SplitError::TrailingData { found: 'x', .. }
        ));
        assert!(matches!(
            e(b"[{}, {\"a\":"),
            SplitError::Truncated { elements: 1 }
        ));
        assert!(matches!(e(b""), SplitError::Truncated { elements: 0 }));
    }

    #[test]
    fn an_element_over_the_limit_fails_naming_its_id() {
        let big = format!(
            r#"[{{"id":"ok"}},{{"id": "m-9x","pad":"{}"}}]"#,
            "x".repeat(100)
        );
        let err = split(&[big.as_bytes()], 64).unwrap_err();
        assert_eq!(
            err,
            SplitError::TooLarge {
                index: 1,
                id: Some("m-9x".into()),
                limit: 64
            }
        );
        assert_eq!(
            err.to_string(),
            "element 1 (id m-9x) is larger than 64 bytes"
        );
        // Across chunks too, and without an id.
        let pad = format!(r#"[{{"pad":"{}"}}]"#, "y".repeat(100));
        let chunks: Vec<&[u8]> = pad.as_bytes().chunks(7).collect();
        assert_eq!(
            split(&chunks, 64).unwrap_err(),
            SplitError::TooLarge {
                index: 0,
                id: None,
                limit: 64
            }
        );
        // Exactly at the limit is fine.
        assert_eq!(split(&[br#"[{"a":1}]"#], 7).unwrap(), [r#"{"a":1}"#]);
    }

    #[test]
    fn the_caller_can_stop_the_split() {
        let mut s = ArraySplitter::new(64);
        let r = s.push(b"[{}, {}, {}]", &mut |_e: &[u8]| {
            Err(SplitError::Truncated { elements: 99 })
        });
        assert_eq!(r, Err(SplitError::Truncated { elements: 99 }));
        assert_eq!(s.elements(), 1);
    }
}
