//! Character-level text for a language model: any UTF-8 file, its vocabulary the sorted
//! distinct characters, split into a training and a validation part, served as windows of
//! `block` tokens whose targets are the next character at every position.
//!
//! ```
//! use ddp_data::{BatchSource, CharText, Dataset};
//!
//! let text = CharText::from_text("hello world, hello text", "inline".as_ref()).unwrap();
//! assert_eq!(text.vocab_size(), 11); // ' ', ',', 'd', 'e', 'h', 'l', 'o', 'r', 't', 'w', 'x'
//! let (train, val) = text.split(0.9, 4).unwrap();
//! assert_eq!(train.len(), 20 - 4); // every start whose window and next token fit
//! assert_eq!(val.len(), 0); // 3 validation tokens: no whole window (see `split`)
//! let mut inputs = [0.0; 4];
//! let mut targets = [0; 4];
//! train.write_sample_targets(0, &mut inputs, &mut targets);
//! assert_eq!(text.decode(&inputs.map(|t| t as u32)), "hell");
//! assert_eq!(text.decode(&targets.map(|t| t as u32)), "ello");
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{BatchSource, DataError, Dataset};

/// A text as character ids, with its vocabulary.
#[derive(Debug, Clone)]
pub struct CharText {
    /// The file (or name) the text came from, for errors.
    source: PathBuf,
    /// The distinct characters, sorted: token `i` is `vocab[i]`.
    vocab: Vec<char>,
    /// The text as token ids.
    tokens: Arc<[u32]>,
}

impl CharText {
    /// Reads the UTF-8 text file `path`. Errors name the file: unreadable, not UTF-8 (with the
    /// byte offset of the first bad byte), or empty.
    pub fn load(path: &Path) -> Result<CharText, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|e| DataError::BadText {
            path: path.to_path_buf(),
            detail: format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        })?;
        CharText::from_text(&text, path)
    }

    /// The text `text`, named `source` in errors; an error when it is empty.
    pub fn from_text(text: &str, source: &Path) -> Result<CharText, DataError> {
        if text.is_empty() {
            return Err(DataError::BadText {
                path: source.to_path_buf(),
                detail: "empty: no characters to learn".into(),
            });
        }
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let tokens = text
            .chars()
            .map(|c| {
                vocab
                    .binary_search(&c)
                    .expect("every char is in the vocabulary") as u32
            })
            .collect();
        Ok(CharText {
            source: source.to_path_buf(),
            vocab,
            tokens,
        })
    }

    /// Distinct characters.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The sorted distinct characters (token `i` is the `i`-th).
    pub fn vocab(&self) -> &[char] {
        &self.vocab
    }

    /// Characters in the text.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the text holds no character (never, for a loaded one).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The text as token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The characters of token ids `tokens` (ids beyond the vocabulary show as `�`).
    pub fn decode(&self, tokens: &[u32]) -> String {
        tokens
            .iter()
            .map(|&t| self.vocab.get(t as usize).copied().unwrap_or('\u{fffd}'))
            .collect()
    }

    /// The first `train_fraction` of the tokens as training windows (every start: overlapping
    /// windows, which a shuffled sampler visits in random order) and the rest as validation
    /// windows (disjoint, so that each validation token is predicted once), `block` tokens
    /// each. An error names the file when the training part holds no window of `block + 1`
    /// tokens; a validation part too short for one is simply empty.
    pub fn split(
        &self,
        train_fraction: f64,
        block: usize,
    ) -> Result<(TextWindows, TextWindows), DataError> {
        if !(train_fraction > 0.0 && train_fraction <= 1.0) || block == 0 {
            return Err(DataError::InvalidArgument(format!(
                "text split: fraction {train_fraction} must be in (0, 1] and block {block} at \
                 least 1"
            )));
        }
        let cut = (self.tokens.len() as f64 * train_fraction) as usize;
        if cut <= block {
            return Err(DataError::BadText {
                path: self.source.clone(),
                detail: format!(
                    "{} characters, {cut} of them for training: too short for a block of {block} \
                     characters and the one after it",
                    self.tokens.len()
                ),
            });
        }
        let windows = |start: usize, end: usize, stride: usize| TextWindows {
            tokens: self.tokens.clone(),
            start,
            end,
            block,
            stride,
        };
        Ok((windows(0, cut, 1), windows(cut, self.tokens.len(), block)))
    }
}

/// Windows of `block` tokens from a range of a text: sample `i` is the tokens from
/// `start + i · stride`, its targets the same window shifted by one token. As a
/// [`BatchSource`] its inputs are the token ids as `f32` (exact below 2²⁴), `[batch, block]`.
#[derive(Debug, Clone)]
pub struct TextWindows {
    tokens: Arc<[u32]>,
    start: usize,
    end: usize,
    block: usize,
    stride: usize,
}

impl TextWindows {
    /// Tokens per window.
    pub fn block(&self) -> usize {
        self.block
    }

    /// The first token of window `index`.
    pub fn window_start(&self, index: usize) -> usize {
        self.start + index * self.stride
    }
}

impl Dataset for TextWindows {
    /// A window's tokens and the next token after each of them.
    type Item = (Vec<u32>, Vec<u32>);

    fn len(&self) -> usize {
        // A window needs `block + 1` tokens (its targets reach one further).
        let span = self.end - self.start;
        if span <= self.block {
            return 0;
        }
        (span - self.block - 1) / self.stride + 1
    }

    fn get(&self, index: usize) -> Option<Self::Item> {
        (index < self.len()).then(|| {
            let s = self.window_start(index);
            (
                self.tokens[s..s + self.block].to_vec(),
                self.tokens[s + 1..s + self.block + 1].to_vec(),
            )
        })
    }
}

impl BatchSource<2> for TextWindows {
    fn batch_shape(&self, batch: usize) -> [usize; 2] {
        [batch, self.block]
    }

    fn write_sample(&self, index: usize, out: &mut [f32]) -> i64 {
        let mut targets = vec![0; self.block];
        self.write_sample_targets(index, out, &mut targets);
        targets[0]
    }

    fn targets_per_sample(&self) -> usize {
        self.block
    }

    fn write_sample_targets(&self, index: usize, out: &mut [f32], targets: &mut [i64]) {
        assert!(index < self.len(), "window {index} of {}", self.len());
        let s = self.window_start(index);
        for (o, &t) in out.iter_mut().zip(&self.tokens[s..s + self.block]) {
            *o = t as f32;
        }
        for (o, &t) in targets
            .iter_mut()
            .zip(&self.tokens[s + 1..s + self.block + 1])
        {
            *o = i64::from(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_are_errors_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("ddp-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.txt");
        std::fs::write(&empty, "").unwrap();
        let err = CharText::load(&empty).unwrap_err().to_string();
        assert!(err.contains("empty.txt") && err.contains("empty"), "{err}");
        let binary = dir.join("bin.txt");
        std::fs::write(&binary, [b'a', b'b', 0xff, b'c']).unwrap();
        let err = CharText::load(&binary).unwrap_err().to_string();
        assert!(err.contains("bin.txt") && err.contains("offset 2"), "{err}");
        let short = dir.join("short.txt");
        std::fs::write(&short, "abcdefghij").unwrap();
        let err = CharText::load(&short)
            .unwrap()
            .split(0.9, 9)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("short.txt") && err.contains("block of 9"),
            "{err}"
        );
        let missing = CharText::load(&dir.join("missing.txt")).unwrap_err();
        assert!(missing.to_string().contains("missing.txt"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Windows and targets against a direct reading of the text; validation windows are
    /// disjoint and cover the validation part up to its last whole window.
    #[test]
    fn windows_are_the_text_and_the_text_one_further() {
        let text: String = "the quick brown fox jumps over the lazy dog".into();
        let t = CharText::from_text(&text, Path::new("x")).unwrap();
        let chars: Vec<char> = text.chars().collect();
        let (train, val) = t.split(0.75, 5).unwrap();
        let cut = (chars.len() as f64 * 0.75) as usize;
        assert_eq!(train.len(), cut - 5);
        for i in 0..train.len() {
            let (x, y) = train.get(i).unwrap();
            assert_eq!(t.decode(&x), chars[i..i + 5].iter().collect::<String>());
            assert_eq!(t.decode(&y), chars[i + 1..i + 6].iter().collect::<String>());
        }
        assert_eq!(val.len(), (chars.len() - cut - 1) / 5);
        let (x, _) = val.get(1).unwrap();
        assert_eq!(
            t.decode(&x),
            chars[cut + 5..cut + 10].iter().collect::<String>()
        );
        assert!(train.get(train.len()).is_none());
    }
}
