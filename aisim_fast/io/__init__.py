"""What a run writes and shows: Parquet/JSON run folders, progress lines."""
