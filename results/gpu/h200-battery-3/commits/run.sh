for c in 0479a4f HEAD 4319c02 5ee56ca f9b8a80; do PYTHONPATH=$PWD/.snap/$c/src timeout 40 python3 .snap/time.py $c 2>&1 | tail -2 | tee -a $OUT/bisect.txt; done
