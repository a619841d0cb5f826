"""Synthetic image-text data for the demo, the tests and the benchmarks (not the real data path).

generate.py writes datasets in every format with a manifest of what each sample is; draw.py
renders the images; bad_samples.py is the corpus of broken and hostile samples with the skip
reason each must get; shard_writers.py writes Parquet / WebDataset / LLaVA files.
"""
