"""Text from a trained model: `python -m titanlite.generate --config NAME --checkpoint DIR
(--prompt TEXT [--prompt TEXT ...] | --prompt-file FILE) [--max-new-tokens N] [--seed S]
[--temperature T] [--top-k K] [--no-kv-cache] [--section.key value ...]` (docs/generate.md).

A check of what a run learned, not a server. Why it is built the way it is:

- The model is the trainer's, built by the trainer's code (`build.plan_run`,
  `build_parts_on_meta` + `materialize`) at whatever layout the world and `--parallelism.*`
  give: FSDP shards, tensor parallel, pipeline stages, and their products. The weights come
  through the trainer's own initial-load path (`checkpoint.restore.Restorer`: DCP, resharded
  by name from any layout, or a Hugging Face folder), after the checks a resume makes: the
  checkpoint's model fingerprint (`restore.check_model`) and its tokenizer. A second model
  or loader could disagree with what training saved; this one cannot (`load.py`).
- A KV cache (`models/kv_cache.py`) for models that take one (`enable_kv_cache`: Llama):
  the prompts' first forward fills it, then each forward computes one new token per row.
  The training forward is the same code with no cache set. A model without one (GPT-2)
  recomputes the whole sequence for every token, as `--no-kv-cache` does for any model:
  the reference the cache is tested against.
- Batches without padding (`decode.py`): every row of a batch sits at the same position.
  The first forward takes the shortest prompt's length from every row; a longer prompt's
  remaining tokens are fed as its next tokens, one per step, while the shorter rows
  generate. Each row thus sees exactly its own tokens at their own positions, as if run
  alone, with no attention mask or position shift to get wrong; the cost is that a long
  prompt's tail goes through one token per forward.
- Pipeline parallel (`stages.py`): decoding is sequential, one step's token is the next
  step's input, so there is nothing for microbatches to overlap. Each step runs the stages
  in order, each on the rank that holds it, and sends the activations to the rank of the
  next stage with plain point-to-point sends on the pp group (a shape, then the tensor).
  A `torch.distributed.pipelining` schedule would add nothing for one microbatch and
  fixes its buffers' shapes at the first step, while decoding changes the sequence length
  between the first forward and the rest. Stage placement follows the configured schedule
  (one stage per rank, looped, or a V), so any layout that trains decodes.
- Sampling happens on one rank, the lowest that holds the output (rank 0 without
  pipeline parallelism), on the CPU with one `torch.Generator` per prompt seeded by
  `--seed`; the chosen tokens are broadcast, so every rank feeds the same sequences and a
  prompt's text depends on its seed only, not on its batch or the layout.
- The input is checked before torch is imported (`cli.py`, as `train.py` does), so a bad
  flag is one `titanlite: error:` line and exit code 2 at once; launched on several
  processes through `python -m titanlite.launch`, an error every rank meets is still one
  line (plain torchrun adds its own traceback to any failed worker).
- Only rank 0 prints: the texts on stdout, its log lines (what was loaded, the compute
  dtype, tokens/s) on stderr, so `> out.txt` keeps only the texts.
"""
