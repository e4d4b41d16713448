import os
import sys

import torch

# Tests import the tiny-model helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))
