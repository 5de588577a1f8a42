export PYTHONDONTWRITEBYTECODE=1
for side in before after before after; do
  PYTHONPATH=$([ $side = before ] && echo _ab/before || echo .) timeout 140 python benchmarks/ab_generate.py $side >> $OUT/ab-generate.log 2>$OUT/ab-generate-$side.err
done
cat $OUT/ab-generate.log
for side in before after before after; do
  PYTHONPATH=$([ $side = before ] && echo _ab/before || echo .) timeout 140 python benchmarks/ab_batch.py $side >> $OUT/ab-batch.log 2>$OUT/ab-batch-$side.err
done
cat $OUT/ab-batch.log; tail -3 $OUT/*.err
