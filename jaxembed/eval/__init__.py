"""MTEB / LongEmbed evaluation (needs mteb: the `eval` extra). See docs/evaluation.md.

    from jaxembed.eval import MtebEncoder, stdlib_tasks, long_document_task
"""

_EXPORTS = {"MtebEncoder": "encoder", "model_meta": "encoder", "stdlib_tasks": "local_tasks",
            "long_document_task": "local_tasks", "aggregate": "summary", "markdown_table": "summary",
            "instruction_for": "instructions"}


def __getattr__(name):  # lazy: importing jaxembed.eval does not import mteb until one of these is used
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"jaxembed.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jaxembed.eval' has no attribute {name!r}")
