"""BERT-Large / BERT-1.5B reference pretraining (MLM + NSP) from h5 shards."""
