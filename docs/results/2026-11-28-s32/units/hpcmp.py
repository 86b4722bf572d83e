import statistics, sys
def load(p):
    d={}
    for l in open(p):
        f=l.split(); d[f[0]]=(int(f[1]),int(f[2]),float(f[3]),float(f[6]))
    return d
b,a=load(sys.argv[1]),load(sys.argv[2])
for w in ['tokens','training','serving','churn']:
    ks=[k for k in b if ('/rec-'+w in k) or (w=='churn' and '/churn-' in k)]
    hb=[b[k][2] for k in ks]; ha=[a[k][2] for k in ks]; pb=[b[k][3] for k in ks]; pa=[a[k][3] for k in ks]
    print(f"{w:8s} n={len(ks):2d} honest before mean {statistics.fmean(hb):.4f} max {max(hb):.4f} | after mean {statistics.fmean(ha):.4f} max {max(ha):.4f} | pool's own: before {statistics.fmean(pb):.4f} after {statistics.fmean(pa):.4f} | better {sum(x<y for x,y in zip(ha,hb))} worse {sum(x>y for x,y in zip(ha,hb))} | <=1.05 before {sum(x<=1.05 for x in hb)} after {sum(x<=1.05 for x in ha)}")
k='/tmp/churn-0.csv'; print('churn draw 0', b[k], a[k])
for k in sorted(b):
    if 'rec-' in k: print(k, b[k][2], a[k][2])
