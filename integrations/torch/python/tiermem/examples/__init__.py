"""The examples that come with the package: ``train_gpt`` (the main job, scripts/train.sh),
``train_distributed`` (the same model sharded across ranks under torchrun) and ``gpt`` (their
GPT-style decoder and synthetic data). The benchmarks live outside the package, in the
repository's ``benchmarks/`` folder (benchmarks/README.md)."""
