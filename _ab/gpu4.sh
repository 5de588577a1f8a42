export PYTHONDONTWRITEBYTECODE=1
timeout 160 python -m pytest tests/test_soak.py::test_soak_gpu tests/test_gpu_e2e.py::test_band_tiles_built_once_per_encoder_table -q -p no:cacheprovider -rf -s > $OUT/soak-band.log 2>&1; echo rc=$? >> $OUT/soak-band.log
tail -12 $OUT/soak-band.log
for side in before after before after; do
  PYTHONPATH=$([ $side = before ] && echo _ab/before || echo .) timeout 100 python benchmarks/ab_generate.py $side >> $OUT/ab-generate.log 2>>$OUT/ab-generate.err
done
cat $OUT/ab-generate.log
for side in before after; do
  PYTHONPATH=$([ $side = before ] && echo _ab/before || echo .) timeout 80 python benchmarks/ab_batch.py $side >> $OUT/ab-batch.log 2>>$OUT/ab-batch.err
done
cat $OUT/ab-batch.log; tail -3 $OUT/*.err
