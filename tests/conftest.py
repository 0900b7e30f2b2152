import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))
