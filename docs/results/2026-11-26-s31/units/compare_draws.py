"""Compare two scripts/replay_draws.py outputs: per workload, the mean and worst peak ratio, draws better
and worse, calls, and (churn) calls a step off peak. python3 compare_draws.py BEFORE AFTER"""
import sys,re
def load(p):
    d={}
    for l in open(p):
        m=re.match(r"\| (\w+) \| (\d+) \| ([\d.]+) \| (\d+) \| ([^|]+)\|",l)
        if m: d[(m[1],int(m[2]))]=(float(m[3]),int(m[4]),m[5].strip())
    return d
if __name__ == "__main__":
    a=load(sys.argv[1]); b=load(sys.argv[2])
    for w in ["tokens","training","serving","churn"]:
        ks=[k for k in a if k[0]==w]
        ra=[a[k][0] for k in ks]; rb=[b[k][0] for k in ks]
        offa=[float(a[k][2].split()[0]) for k in ks if a[k][2]!='-']; offb=[float(b[k][2].split()[0]) for k in ks if b[k][2]!='-']
        better=sum(1 for k in ks if b[k][0]<a[k][0]); worse=sum(1 for k in ks if b[k][0]>a[k][0])
        print(w, "mean %.4f -> %.4f"%(sum(ra)/len(ra),sum(rb)/len(rb)), "max %.3f -> %.3f"%(max(ra),max(rb)), "better %d worse %d"%(better,worse),
          "calls %d -> %d"%(sum(a[k][1] for k in ks),sum(b[k][1] for k in ks)),
          ("offpeak %.2f -> %.2f, <=2: %d -> %d, <=1.05: %d -> %d"%(sum(offa)/len(offa),sum(offb)/len(offb),sum(x<=2 for x in offa),sum(x<=2 for x in offb),sum(x<=1.05 for x in ra),sum(x<=1.05 for x in rb)) if offa else ""))
