"""The runtime every training rank imports, shared by every model, in rooms (config, schedule, run, rank, compat,
device, outputs, checkpoint): docs/layout.md says what each holds and who imports whom. Offline tools are in
ds_tools, which no rank imports."""
