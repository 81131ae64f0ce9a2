source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels
mkdir -p $OUT/results
timeout 420 python3 -m dsv41.cli bench decode --layers 2,3,20,24 --batch 1,8 --context 4096 --out $OUT/results > $OUT/bench_decode.log 2>&1
echo "bench rc $?"
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/streams/test_streams_gpu.py -k fx > $OUT/stress.log 2>&1; echo "stress rc $?" >> $OUT/stress.log
tail -4 $OUT/stress.log
grep -v -i warn $OUT/bench_decode.log | grep -v "^ *$" | grep -v "softmax\|important use case\|Inductor decides" | tail -40
