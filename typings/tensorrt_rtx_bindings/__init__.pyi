from tensorrt import *  # the same interface under TensorRT-RTX
from tensorrt import __version__ as __version__
