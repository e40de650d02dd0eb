"""What the accelerator can do: the published peak table (accelerators), the precision rule and the measured CPU peak
(precision), and whether DeepSpeed's compiled ops can be built here (ops_check)."""
