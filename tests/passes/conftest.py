import torch

# The machine has 2 shared cores: intra-op threads oversubscribe them and slow tiny convs down ~50x.
torch.set_num_threads(1)
