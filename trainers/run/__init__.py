"""The run every trainer shares.

The training loop (`skeleton`), how a run resumes after a kill (`run_state`,
`event_files`), its --model_dir (`model_dirs`), where input data is checked
(`data_checks`) and the one-line endings of bad input (`errors`).
"""
