export PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/smi.txt
python -c "import torch,triton,transformers,sys;print(torch.__version__,triton.__version__,transformers.__version__,sys.version)" > $OUT/versions.txt
timeout 540 python -m pytest tests -m gpu -q -p no:cacheprovider -rf > $OUT/gpu-suite.log 2>&1; echo rc=$? >> $OUT/gpu-suite.log
tail -30 $OUT/gpu-suite.log
