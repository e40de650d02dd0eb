"""bert-prep: raw text -> balanced text shards -> WordPiece vocab -> h5 pretraining shards (NVIDIA layout) -> check."""
