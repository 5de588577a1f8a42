export PYTHONDONTWRITEBYTECODE=1
timeout 320 python -m pytest tests -m gpu --deselect tests/test_soak.py::test_soak_gpu -q -p no:cacheprovider -rf --durations=15 > $OUT/gpu-suite.log 2>&1; echo rc=$? >> $OUT/gpu-suite.log
tail -40 $OUT/gpu-suite.log
timeout 250 python -m pytest tests/test_soak.py::test_soak_gpu -q -p no:cacheprovider -rf -s --durations=3 > $OUT/soak.log 2>&1; echo rc=$? >> $OUT/soak.log
tail -15 $OUT/soak.log
