import sys,re,statistics as st
def load(p):
    d={}
    for l in open(p):
        m=re.match(r"\| (\w+) \| (\d+) \| ([\d.]+) \| (\d+) \| ([^|]+)\|",l)
        if m: d[(m[1],int(m[2]))]=(float(m[3]),int(m[4]),m[5].strip())
    return d
a=load(sys.argv[1]); b=load(sys.argv[2])
ks=[k for k in a if k[0]=="churn"]
d=[b[k][0]-a[k][0] for k in ks]
c=[float(b[k][2].split()[0])-float(a[k][2].split()[0]) for k in ks]
print("n=%d ratio diff mean %.4f se %.4f; offpeak diff mean %.2f se %.2f"%(len(d),st.mean(d),st.stdev(d)/len(d)**.5,st.mean(c),st.stdev(c)/len(c)**.5))
