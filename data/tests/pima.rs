//! Pima: the bundled CSV, the stratified split and standardisation, and bad CSV input.

use ddp_data::pima::{BUNDLED_CSV, NUM_FEATURES};
use ddp_data::{BatchSource, DataError, Dataset, PimaTable};

/// The bundled copy is the published data set: its SHA-256 as given with the data set (an
/// independent record), the known row count and class balance, the first row; and a file on
/// disk with the same bytes loads to the same table.
#[test]
fn bundled_table_is_the_published_file() {
    use sha2::{Digest, Sha256};
    let digest: String = Sha256::digest(BUNDLED_CSV.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        digest,
        "06f5b7c2cd7bca686fda4f92eab5f61e7ff6426a9acefa2e3dda04fc54293cf5"
    );
    let table = PimaTable::load(None).unwrap();
    assert_eq!(table.len(), 768);
    assert_eq!(table.labels().iter().filter(|&&l| l == 1).count(), 268);
    let first = table.get(0).unwrap();
    assert_eq!(
        first.features,
        [6.0, 148.0, 72.0, 35.0, 0.0, 33.6, 0.627, 50.0]
    );
    assert_eq!(first.label, 1);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("pima-indians-diabetes.csv");
    std::fs::write(&path, BUNDLED_CSV).unwrap();
    assert_eq!(PimaTable::load(Some(&path)).unwrap(), table);
}

#[test]
fn stratified_split_is_seeded_and_disjoint() {
    let table = PimaTable::load(None).unwrap();
    let split = table.split(0.2, 0).unwrap();
    assert_eq!((split.train.len(), split.test.len()), (614, 154));
    let positives = |labels: &[u8]| labels.iter().filter(|&&l| l == 1).count();
    assert_eq!(positives(split.train.labels()), 214);
    assert_eq!(positives(split.test.labels()), 54);

    let mut all: Vec<usize> = split
        .train
        .source_rows()
        .iter()
        .chain(split.test.source_rows())
        .copied()
        .collect();
    all.sort_unstable();
    assert_eq!(all, (0..768).collect::<Vec<_>>());

    assert_eq!(table.split(0.2, 0).unwrap(), split);
    let other = table.split(0.2, 1).unwrap();
    assert_ne!(other.test.source_rows(), split.test.source_rows());
    assert_eq!(other.test.len(), 154);

    let none = table.split(0.0, 0).unwrap();
    assert_eq!((none.train.len(), none.test.len()), (768, 0));
    assert!(matches!(
        table.split(1.0, 0),
        Err(DataError::InvalidArgument(_))
    ));
    assert!(matches!(
        table.split(-0.1, 0),
        Err(DataError::InvalidArgument(_))
    ));
}

#[test]
fn features_are_standardised_with_training_statistics_only() {
    let table = PimaTable::load(None).unwrap();
    let split = table.split(0.25, 7).unwrap();
    // Statistics recomputed here from the raw training rows.
    let rows = split.train.source_rows();
    for j in 0..NUM_FEATURES {
        let values: Vec<f64> = rows
            .iter()
            .map(|&r| f64::from(table.get(r).unwrap().features[j]))
            .collect();
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let std =
            (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64).sqrt();
        assert!(
            (f64::from(split.standardizer.mean[j]) - mean).abs() < 1e-3 * mean.abs().max(1.0),
            "feature {j}"
        );
        assert!(
            (f64::from(split.standardizer.std[j]) - std).abs() < 1e-3 * std,
            "feature {j}"
        );
        // The training features come out with mean 0 and std 1.
        let z: Vec<f64> = (0..split.train.len())
            .map(|i| f64::from(split.train.get(i).unwrap().features[j]))
            .collect();
        let zmean = z.iter().sum::<f64>() / z.len() as f64;
        let zstd = (z.iter().map(|v| (v - zmean).powi(2)).sum::<f64>() / z.len() as f64).sqrt();
        assert!(
            zmean.abs() < 1e-4 && (zstd - 1.0).abs() < 1e-4,
            "feature {j}: {zmean} {zstd}"
        );
    }
    // A test row is standardised with the same (training) statistics.
    let i = 3;
    let raw = table.get(split.test.source_rows()[i]).unwrap();
    let z = split.test.get(i).unwrap();
    assert_eq!(z.label, raw.label);
    for j in 0..NUM_FEATURES {
        let want = (raw.features[j] - split.standardizer.mean[j]) / split.standardizer.std[j];
        assert_eq!(z.features[j], want);
    }
    let mut out = [0f32; NUM_FEATURES];
    assert_eq!(split.test.write_sample(i, &mut out), i64::from(raw.label));
    assert_eq!(out, z.features);
    assert_eq!(split.test.batch_shape(5), [5, 8]);
}

#[test]
fn csv_row_with_a_missing_column() {
    let text =
        "6,148,72,35,0,33.6,0.627,50,1\n1,85,66,29,0,26.6,0.351,31,0\n8,183,64,0,0,23.3,0.672,1\n";
    let err = PimaTable::parse(text, "my.csv").unwrap_err();
    assert!(
        matches!(
            err,
            DataError::Csv {
                line: 3,
                column: None,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "my.csv:3: expected 9 columns (8 features and the label), found 8"
    );
}

#[test]
fn csv_field_that_is_not_a_number() {
    let text = "6,148,72,35,0,33.6,0.627,50,1\n1,85,66,abc,0,26.6,0.351,31,0\n";
    let err = PimaTable::parse(text, "my.csv").unwrap_err();
    assert_eq!(
        err.to_string(),
        "my.csv:2:4: expected a finite number, found \"abc\""
    );
    let err = PimaTable::parse("1,2,3,4,5,6,7,,0", "x.csv").unwrap_err();
    assert_eq!(
        err.to_string(),
        "x.csv:1:8: expected a finite number, found \"\""
    );
    let err = PimaTable::parse("1,2,3,4,5,6,7,NaN,0", "x.csv").unwrap_err();
    assert_eq!(
        err.to_string(),
        "x.csv:1:8: expected a finite number, found \"NaN\""
    );
    let err = PimaTable::parse("1,2,3,4,5,6,7,8,2", "x.csv").unwrap_err();
    assert_eq!(
        err.to_string(),
        "x.csv:1:9: the label must be 0 or 1, found 2"
    );
}

#[test]
fn csv_errors_from_a_file_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("pima.csv");
    std::fs::write(&path, "1,2,3,4,5,6,7,8,0\n\n1,2,3,4,5,6,7,8,0,9\n").unwrap();
    let err = PimaTable::load(Some(&path)).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}:3: expected 9 columns (8 features and the label), found 10",
            path.display()
        )
    );
    let err = PimaTable::load(Some(&tmp.path().join("absent.csv"))).unwrap_err();
    assert!(matches!(err, DataError::Io { .. }), "{err:?}");
    // Windows line endings and blank lines are fine.
    let table = PimaTable::parse(
        "1,2,3,4,5,6,7,8,0\r\n\r\n 1, 2,3,4,5,6,7,8,1 \r\n",
        "crlf.csv",
    )
    .unwrap();
    assert_eq!(table.labels(), &[0, 1]);
}
