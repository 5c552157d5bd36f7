"""jaxembed models as mteb (2.x) encoders, with the paper's instructions (Appendix H).

    from jaxembed.eval import MtebEncoder
    model = MtebEncoder(jaxembed.load("runs/model"), name="me/mamba2-embed", max_length=512)
    mteb.evaluate(model, mteb.get_tasks(["SciFact"]), cache=mteb.ResultCache("results"))

Every call goes through `Embedder.encode(texts, prompt=prefix)`: EOS appended, length-sorted buckets, vertical chunking
("auto": Appendix F's V), so a 32k-token LongEmbed document runs in the memory of V tokens.
`calls` records, per encode call, the task, the text role, the prefix used and the truncation
count, so what reached the model can be checked and reported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder

from jaxembed.eval.instructions import applies_to, instruction_for
from jaxembed.text import check_query_template

INSTRUCTION_MODES = ("paper", "paper-only", "none")
# the two templates the paper and E5 use ("{prompt}" is the instruction)
TEMPLATES = {"paper": "Instruction: {prompt}\nQuery: ", "e5": "Instruct: {prompt}\nQuery: "}


@dataclass
class EncodeCall:
    task: str
    task_type: str
    prompt_type: str | None  # "query", "document" or None
    prefix: str
    instruction_source: str  # "paper-task", "paper-type", "mteb-task" or "none"
    texts: int
    truncated: int


class MtebEncoder(AbsEncoder):
    """mteb's EncoderProtocol over a `jaxembed.Embedder`.

    instructions: "paper" (Appendix H, then the task's own mteb prompt for tasks the paper does
    not name), "paper-only" (Appendix H only) or "none".
    template: "paper", "e5" or a string with "{prompt}"; default: the embedder's query template.
    max_length: tokens per text, EOS included (the paper: 512 for MTEB, 32768 for LongEmbed);
    longer texts are cut and counted in `calls` and `truncated`. None: no limit.
    """

    def __init__(self, embedder, *, name: str = "jaxembed/model", revision: str | None = None,
                 max_length: int | None = 512, batch_size: int = 32, vertical_chunk_size="auto",
                 instructions: str = "paper", template: str | None = None, show_progress_bar: bool = False,
                 task_instructions: dict | None = None, type_instructions: dict | None = None,
                 release_date: str | None = None):
        if instructions not in INSTRUCTION_MODES:
            raise ValueError(f"instructions must be one of {INSTRUCTION_MODES}, got {instructions!r}")
        template = embedder.query_template if template is None else TEMPLATES.get(template, template)
        check_query_template(template, name="template ('paper', 'e5' or a template)")
        if "/" not in name:
            raise ValueError(f"name must look like 'organization/model' (mteb's results layout), got {name!r}")
        self.model = embedder
        self.template = template
        self.instructions = instructions
        self.task_instructions = task_instructions
        self.type_instructions = type_instructions
        self.max_length = max_length
        self.batch_size = batch_size
        self.vertical_chunk_size = vertical_chunk_size
        self.show_progress_bar = show_progress_bar
        self.calls: list[EncodeCall] = []
        self.mteb_model_meta = model_meta(embedder, name=name, revision=revision, max_tokens=max_length,
                                          release_date=release_date)

    # ---- instructions -----------------------------------------------------------------
    def instruction(self, task_metadata, prompt_type: str | None) -> tuple[str | None, str]:
        """(instruction or None, where it came from) for this task and text role."""
        if self.instructions == "none":
            return None, "none"
        name, task_type = task_metadata.name, task_metadata.type
        text = instruction_for(name, task_type, task_instructions=self.task_instructions,
                               type_instructions=self.type_instructions)
        if text is not None:
            in_task_table = instruction_for(name, "", task_instructions=self.task_instructions, type_instructions={})
            return text, "paper-task" if in_task_table is not None else "paper-type"
        if self.instructions == "paper":
            prompt = task_metadata.prompt
            if isinstance(prompt, dict):
                prompt = prompt.get(prompt_type or "query")
            if prompt:
                return prompt, "mteb-task"
        return None, "none"

    def prefix(self, task_metadata, prompt_type: str | None) -> tuple[str, str]:
        """The literal prefix of every text of this role, and the instruction's source."""
        if not applies_to(task_metadata.type, prompt_type):
            return "", "none"
        text, source = self.instruction(task_metadata, prompt_type)
        return ("", "none") if text is None else (self.template.format(prompt=text), source)

    def check_prefixes(self, tasks) -> None:
        """Before any encoding: a task whose prefix fills max_length on its own (every text would embed as the
        prefix: identical embeddings, nan scores) is named, with the lengths."""
        from mteb.abstasks.aggregated_task import AbsTaskAggregate

        leaves = [leaf for task in tasks
                  for leaf in (task.metadata.tasks if isinstance(task, AbsTaskAggregate) else [task])]
        for task in leaves:
            for role in (None, "query", "document"):
                prefix, _ = self.prefix(task.metadata, role)
                try:
                    self.model._check_room_after(prefix, self.max_length)
                except ValueError as err:
                    raise ValueError(f"task {task.metadata.name}: {err}") from None

    # ---- mteb's protocol ----------------------------------------------------------------
    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs) -> np.ndarray:
        texts = [text for batch in inputs for text in batch["text"]]
        role = None if prompt_type is None else getattr(prompt_type, "value", prompt_type)
        prefix, source = self.prefix(task_metadata, role)
        with warnings.catch_warnings():  # cuts are counted per call (self.calls) and reported once
            warnings.simplefilter("ignore", UserWarning)
            out = self.model.encode(texts, prompt=prefix or None, max_length=self.max_length,
                                    batch_size=self.batch_size, vertical_chunk_size=self.vertical_chunk_size,
                                    show_progress_bar=self.show_progress_bar)
        self.calls.append(EncodeCall(task_metadata.name, task_metadata.type, role, prefix, source, len(texts),
                                     self.model.last_stats.get("truncated", 0)))
        return out

    def similarity(self, embeddings1, embeddings2):
        """Cosine similarity [n, m]; a 1-D argument drops its axis (two vectors give a scalar)."""
        a, b = _unit(embeddings1), _unit(embeddings2)
        return a @ b.T if b.ndim == 2 else a @ b

    def similarity_pairwise(self, embeddings1, embeddings2):
        return (_unit(embeddings1) * _unit(embeddings2)).sum(-1)

    def truncated(self, task: str | None = None) -> int:
        return sum(c.truncated for c in self.calls if task is None or c.task == task)


def _unit(x) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def model_meta(embedder, *, name: str, revision: str | None, max_tokens: int | None, release_date=None) -> ModelMeta:
    """mteb's ModelMeta of a jaxembed model: framework JAX, cosine similarity, EOS pooling."""
    import jax

    n_parameters = int(sum(np.prod(x.shape) for x in jax.tree.leaves(embedder.params)))
    return ModelMeta(
        loader=None, name=name, revision=revision or "local", release_date=release_date,
        languages=None, n_parameters=n_parameters, memory_usage_mb=None,
        max_tokens=float(max_tokens) if max_tokens is not None else float("inf"),
        embed_dim=int(embedder.embedding_dim), license=None, open_weights=True, public_training_code=None,
        public_training_data=None, framework=["JAX"], similarity_fn_name="cosine", use_instructions=True,
        training_datasets=None, reference="https://github.com/jaxembed/jaxembed",
    )
