from pathlib import Path

# How the toy world's Eagle-3 draft is pretrained (the demo's initial and fresh reference drafts).
# Package data, so `draftadapt demo` runs from any directory; recipes/pretrain_eagle3_toy.yaml
# links to it for the `draftadapt pretrain` command line.
PRETRAIN_RECIPE = Path(__file__).with_name("pretrain_eagle3.yaml")
