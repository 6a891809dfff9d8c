"""The ``lookup-medusa`` drafter (the quickstart's): prompt lookup merged with confidence-gated
Medusa heads.

- :class:`~headway.drafters.confident_drafter.ConfidentMedusaDrafter` drafts the heads' top-1
  chain only while its cumulative probability stays at or above ``confidence`` (the quickstart
  calibrates it on held-out data, :mod:`headway.quickstart.calibrate`), optionally over a draft
  vocabulary of the training data's most frequent tokens (a cheaper ``[V', H]`` projection).
- :class:`~headway.drafters.merged.MergedDrafter` proposes the union of prompt lookup's tree and
  the heads' chain, merged as a prefix tree within a node budget, prompt lookup's paths first,
  and counts which drafter proposed each accepted token.

Drafts never affect what is committed (the target verifies every token), so none of this
touches exactness; it only decides how much verification work is spent, and on what.
"""

from __future__ import annotations

from pathlib import Path

from headway.decode.generate import Drafter
from headway.drafters.confident_drafter import ConfidentMedusaDrafter
from headway.drafters.draft_vocab import draft_vocabulary, narrow_medusa
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.merged import MergedDrafter
from headway.drafters.specs import LookupMedusaSpec
from headway.errors import HeadwayError
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from headway.heads.loading import FoundHeads
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import Target, resolve_dtype

__all__ = ["lookup_medusa_drafter"]


def lookup_medusa_drafter(
    target: Target, spec: LookupMedusaSpec, found: FoundHeads
) -> MergedDrafter:
    """The drafter of ``spec`` on ``target``, with the Medusa heads ``found`` in ``spec.heads``.

    Raises:
        HeadwayError: the heads are not Medusa heads, or the draft vocabulary's data holds no
            answers.
    """
    if not isinstance(found.config, MedusaConfig):
        raise HeadwayError(f"{spec.heads}: lookup-medusa needs Medusa heads, found {found.method}")
    device = target.model.get_output_embeddings().weight.device
    dtype = resolve_dtype(spec.draft_dtype)
    keep = None
    if spec.draft_vocab:
        keep = draft_vocabulary(Path(spec.draft_vocab), target.tokenizer, spec.draft_vocab_size)
    config, state, vocab = narrow_medusa(found.config, found.state_dict, keep)
    heads = MedusaHeads.trained(config, state, device=device, dtype=dtype)
    layer = final_hidden_layer(target.model)
    check_final_hidden(target.model, layer)
    drafters: list[Drafter] = []
    if spec.lookup:
        drafters.append(
            PromptLookupDrafter(
                min_ngram=spec.lookup_min_ngram,
                max_ngram=spec.lookup_max_ngram,
                num_draft_tokens=spec.lookup_tokens,
                max_nodes=spec.lookup_tokens,
            )
        )
    num_heads = found.config.num_heads
    drafters.append(
        ConfidentMedusaDrafter(
            heads, hidden_layer=layer, threshold=spec.confidence, max_depth=num_heads, vocab=vocab
        )
    )
    budget = (spec.lookup_tokens if spec.lookup else 0) + num_heads
    return MergedDrafter(drafters, max_nodes=budget)
