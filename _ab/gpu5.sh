export PYTHONDONTWRITEBYTECODE=1
for side in before after before after; do
  PYTHONPATH=$([ $side = before ] && echo _ab/before || echo .) timeout 70 python benchmarks/ab_batch.py $side --shapes t5-large --beams 1 >> $OUT/ab-batch-large.log 2>>$OUT/ab-batch-large.err
  cat $OUT/ab-batch-large.log | tail -1
done
