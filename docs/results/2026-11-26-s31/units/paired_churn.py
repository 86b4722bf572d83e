"""Churn's per-draw differences between two scripts/replay_draws.py outputs: the mean change of the
peak ratio and of calls a step off peak, with standard errors. python3 paired_churn.py BEFORE AFTER"""
import sys,re,statistics as st
sys.path.insert(0, __import__('os').path.dirname(__file__))
from compare_draws import load  # noqa: E402
a=load(sys.argv[1]); b=load(sys.argv[2])
ks=[k for k in a if k[0]=="churn"]
d=[b[k][0]-a[k][0] for k in ks]
c=[float(b[k][2].split()[0])-float(a[k][2].split()[0]) for k in ks]
print("n=%d ratio diff mean %.4f se %.4f; offpeak diff mean %.2f se %.2f"%(len(d),st.mean(d),st.stdev(d)/len(d)**.5,st.mean(c),st.stdev(c)/len(c)**.5))
