// Command etcd is etcd's own server (go.etcd.io/etcd/server/v3/etcdmain), built at the version
// the Kubernetes release was tested with, for the real-cluster test tier.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
