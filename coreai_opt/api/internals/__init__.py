"""What the API entry points share and users never call: input checks, batches, snapshots, the model guard."""
