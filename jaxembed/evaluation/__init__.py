"""MTEB / LongEmbed evaluation (needs the `eval` extra: mteb). See docs/evaluation.md."""
