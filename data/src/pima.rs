//! Pima Indians Diabetes: the CSV (768 rows of 8 features and a 0/1 label, no header), a seeded
//! stratified train/test split, and standardisation with the training split's statistics.
//!
//! The data set is bundled in the crate (23 KB), so `PimaTable::load(None)` works anywhere; a
//! path reads another file of the same layout instead.
//!
//! The split is **stratified**: each class is shuffled on its own and the same fraction of each
//! goes to the test set, so both sets keep the 268/500 (35% positive) balance. With 154 test rows
//! a plain random split would move the test set's positive rate by several points from seed to
//! seed, and accuracy with it. Within each set rows keep their file order (the sampler shuffles).
//!
//! Standardisation is `(x - mean) / std` per feature, mean and population standard deviation
//! taken over the training rows only (a feature constant over them gets std 1), so nothing of
//! the test set leaks into training. Zeros that stand for missing values in columns 2-6 are kept
//! as zeros, like the usual Keras and PyTorch tutorials do.

use std::path::Path;

use crate::sampler::SplitMix64;
use crate::{BatchSource, DataError, Dataset};

/// Number of feature columns.
pub const NUM_FEATURES: usize = 8;
/// The bundled CSV file.
pub const BUNDLED_CSV: &str = include_str!("../assets/pima-indians-diabetes.csv");
const BUNDLED_NAME: &str = "<bundled pima-indians-diabetes.csv>";
/// Names of the feature columns, in file order.
pub const FEATURE_NAMES: [&str; NUM_FEATURES] = [
    "pregnancies",
    "glucose",
    "blood_pressure",
    "skin_thickness",
    "insulin",
    "bmi",
    "diabetes_pedigree",
    "age",
];

/// One Pima sample, as returned by [`Dataset::get`] (standardised features in a [`Pima`], raw
/// ones in a [`PimaTable`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PimaItem {
    /// The eight features, in [`FEATURE_NAMES`] order.
    pub features: [f32; NUM_FEATURES],
    /// 1 = diabetic, 0 = not.
    pub label: u8,
}

/// The raw table as read from the CSV, before splitting.
#[derive(Debug, Clone, PartialEq)]
pub struct PimaTable {
    features: Vec<[f32; NUM_FEATURES]>,
    labels: Vec<u8>,
}

/// Per-feature mean and standard deviation, from a training split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Standardizer {
    /// Mean of each feature.
    pub mean: [f32; NUM_FEATURES],
    /// Population standard deviation of each feature (1 where the feature is constant).
    pub std: [f32; NUM_FEATURES],
}

/// A standardised split of Pima: a dataset for the loader.
#[derive(Debug, Clone, PartialEq)]
pub struct Pima {
    features: Vec<[f32; NUM_FEATURES]>,
    labels: Vec<u8>,
    rows: Vec<usize>,
}

/// The result of [`PimaTable::split`].
#[derive(Debug, Clone, PartialEq)]
pub struct PimaSplit {
    /// The training rows, standardised.
    pub train: Pima,
    /// The test rows, standardised with the training statistics.
    pub test: Pima,
    /// The statistics used (from the training rows).
    pub standardizer: Standardizer,
}

impl PimaTable {
    /// Reads the CSV at `path`, or the bundled copy when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<PimaTable, DataError> {
        match path {
            None => PimaTable::parse(BUNDLED_CSV, BUNDLED_NAME),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(DataError::io(path))?;
                PimaTable::parse(&text, &path.display().to_string())
            }
        }
    }

    /// Parses CSV text: 9 comma-separated numbers a row (8 features, then a 0/1 label), no
    /// header; blank lines are skipped. `name` names the source in errors.
    pub fn parse(text: &str, name: &str) -> Result<PimaTable, DataError> {
        let err = |line: usize, column: Option<usize>, message: String| DataError::Csv {
            file: name.to_string(),
            line,
            column,
            message,
        };
        let mut features = Vec::new();
        let mut labels = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let row = raw.trim();
            if row.is_empty() {
                continue;
            }
            let fields: Vec<&str> = row.split(',').collect();
            if fields.len() != NUM_FEATURES + 1 {
                return Err(err(
                    line,
                    None,
                    format!(
                        "expected {} columns (8 features and the label), found {}",
                        NUM_FEATURES + 1,
                        fields.len()
                    ),
                ));
            }
            let mut values = [0f32; NUM_FEATURES + 1];
            for (c, (field, value)) in fields.iter().zip(values.iter_mut()).enumerate() {
                let field = field.trim();
                *value = match field.parse::<f32>() {
                    Ok(v) if v.is_finite() => v,
                    _ => {
                        return Err(err(
                            line,
                            Some(c + 1),
                            format!("expected a finite number, found {field:?}"),
                        ))
                    }
                };
            }
            let label = values[NUM_FEATURES];
            if label != 0.0 && label != 1.0 {
                return Err(err(
                    line,
                    Some(NUM_FEATURES + 1),
                    format!("the label must be 0 or 1, found {label}"),
                ));
            }
            let mut f = [0f32; NUM_FEATURES];
            f.copy_from_slice(&values[..NUM_FEATURES]);
            features.push(f);
            labels.push(label as u8);
        }
        Ok(PimaTable { features, labels })
    }

    /// The labels, in file order.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// Splits the rows into a training and a test set, stratified by label and determined by
    /// `seed`, and standardises both with the training statistics. Each class contributes
    /// `round(count * test_fraction)` rows to the test set (54 positive and 100 negative of 768
    /// for 0.2). `test_fraction` must lie in `[0, 1)`.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<PimaSplit, DataError> {
        if !(0.0..1.0).contains(&test_fraction) {
            return Err(DataError::InvalidArgument(format!(
                "test_fraction {test_fraction} is not in [0, 1)"
            )));
        }
        let mut train_rows = Vec::new();
        let mut test_rows = Vec::new();
        for class in [0u8, 1] {
            let mut rows: Vec<usize> = (0..self.len())
                .filter(|&i| self.labels[i] == class)
                .collect();
            // A stream per class, so the two classes are shuffled independently.
            let mut rng = SplitMix64::for_stream(seed, 0x5049_4d41 + u64::from(class));
            for i in (1..rows.len()).rev() {
                rows.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let n_test = (rows.len() as f64 * test_fraction).round() as usize;
            test_rows.extend_from_slice(&rows[..n_test]);
            train_rows.extend_from_slice(&rows[n_test..]);
        }
        train_rows.sort_unstable();
        test_rows.sort_unstable();
        let standardizer = Standardizer::fit(train_rows.iter().map(|&i| &self.features[i]));
        Ok(PimaSplit {
            train: self.subset(&train_rows, &standardizer),
            test: self.subset(&test_rows, &standardizer),
            standardizer,
        })
    }

    fn subset(&self, rows: &[usize], standardizer: &Standardizer) -> Pima {
        Pima {
            features: rows
                .iter()
                .map(|&i| standardizer.apply(&self.features[i]))
                .collect(),
            labels: rows.iter().map(|&i| self.labels[i]).collect(),
            rows: rows.to_vec(),
        }
    }
}

impl Dataset for PimaTable {
    type Item = PimaItem;

    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get(&self, index: usize) -> Option<PimaItem> {
        Some(PimaItem {
            features: *self.features.get(index)?,
            label: self.labels[index],
        })
    }
}

impl Standardizer {
    /// Mean and population standard deviation of each feature over `rows` (mean 0 and std 1
    /// for no rows; std 1 for a constant feature).
    pub fn fit<'a>(rows: impl Iterator<Item = &'a [f32; NUM_FEATURES]> + Clone) -> Standardizer {
        let mut n = 0f64;
        let mut sum = [0f64; NUM_FEATURES];
        for row in rows.clone() {
            n += 1.0;
            for (s, &x) in sum.iter_mut().zip(row) {
                *s += f64::from(x);
            }
        }
        let mean = sum.map(|s| if n > 0.0 { s / n } else { 0.0 });
        let mut sq = [0f64; NUM_FEATURES];
        for row in rows {
            for ((s, &x), m) in sq.iter_mut().zip(row).zip(mean) {
                *s += (f64::from(x) - m).powi(2);
            }
        }
        let std = sq.map(|s| {
            let sd = if n > 0.0 { (s / n).sqrt() } else { 0.0 };
            if sd > 0.0 {
                sd as f32
            } else {
                1.0
            }
        });
        Standardizer {
            mean: mean.map(|m| m as f32),
            std,
        }
    }

    /// Standardises one row.
    pub fn apply(&self, row: &[f32; NUM_FEATURES]) -> [f32; NUM_FEATURES] {
        std::array::from_fn(|j| (row[j] - self.mean[j]) / self.std[j])
    }
}

impl Pima {
    /// For each sample, its line's position among the rows of the CSV (0-based).
    pub fn source_rows(&self) -> &[usize] {
        &self.rows
    }

    /// The labels.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }
}

impl Dataset for Pima {
    type Item = PimaItem;

    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get(&self, index: usize) -> Option<PimaItem> {
        Some(PimaItem {
            features: *self.features.get(index)?,
            label: self.labels[index],
        })
    }
}

impl BatchSource<2> for Pima {
    fn batch_shape(&self, batch: usize) -> [usize; 2] {
        [batch, NUM_FEATURES]
    }

    fn write_sample(&self, index: usize, out: &mut [f32]) -> i64 {
        out.copy_from_slice(&self.features[index]);
        i64::from(self.labels[index])
    }
}
