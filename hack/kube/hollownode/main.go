// Command hollownode is a kubemark hollow node whose kubelet has the real DRA manager.
//
// kubemark's hollow kubelet (k8s.io/kubernetes/pkg/kubemark) runs the real kubelet code against a
// fake container runtime, but with the stub container manager, whose DRA half does nothing: no
// plugin registration handler, no NodePrepareResources. This program builds the same hollow
// kubelet with a container manager that is the stub for cgroups, CPUs and memory and the
// kubelet's own DRA manager (k8s.io/kubernetes/pkg/kubelet/cm/dra) for everything DRA: it
// watches <root-dir>/plugins_registry, registers DRA plugins, prepares a pod's claims before
// its containers start, hands their CDI device IDs to the runtime, unprepares them when the pod
// is gone, keeps its claim-info checkpoint under the root dir, watches the plugins' health
// streams and wipes a plugin's ResourceSlices when it goes away, as a real kubelet's
// containerManagerImpl does.
//
// The fake runtime's CreateContainer calls are written to --cdi-log as JSON lines (pod, container,
// CDI device IDs): what a real runtime would be asked to inject.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	internalapi "k8s.io/cri-api/pkg/apis"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	remote "k8s.io/cri-client/pkg"
	fakeremote "k8s.io/cri-client/pkg/fake"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	kubefeatures "k8s.io/kubernetes/pkg/features"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/apis/config"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/cm"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/cm/resourceupdates"
	"k8s.io/kubernetes/pkg/kubelet/config"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/kubernetes/pkg/kubelet/status"
	"k8s.io/kubernetes/pkg/kubemark"
)

// draContainerManager is the stub container manager with the kubelet's real DRA manager.
type draContainerManager struct {
	cm.ContainerManager
	dra *dra.Manager
}

func (c *draContainerManager) Start(ctx context.Context, node *v1.Node, activePods cm.ActivePodsFunc,
	getNode cm.GetNodeFunc, sourcesReady config.SourcesReady, podStatusProvider status.PodStatusProvider,
	runtimeService internalapi.RuntimeService, localStorageCapacityIsolation bool) error {
	if err := c.ContainerManager.Start(ctx, node, activePods, getNode, sourcesReady, podStatusProvider,
		runtimeService, localStorageCapacityIsolation); err != nil {
		return err
	}
	return c.dra.Start(ctx, dra.ActivePodsFunc(activePods), dra.GetNodeFunc(getNode), sourcesReady)
}

func (c *draContainerManager) GetPluginRegistrationHandlers() map[string]cache.PluginHandler {
	handlers := c.ContainerManager.GetPluginRegistrationHandlers()
	merged := map[string]cache.PluginHandler{pluginwatcherapi.DRAPlugin: c.dra.GetWatcherHandler()}
	for name, handler := range handlers {
		merged[name] = handler
	}
	return merged
}

func (c *draContainerManager) GetResources(ctx context.Context, pod *v1.Pod,
	container *v1.Container) (*kubecontainer.RunContainerOptions, error) {
	opts, err := c.ContainerManager.GetResources(ctx, pod, container)
	if err != nil {
		return nil, err
	}
	info, err := c.dra.GetResources(pod, container)
	if err != nil {
		return nil, err
	}
	opts.CDIDevices = append(opts.CDIDevices, info.CDIDevices...)
	return opts, nil
}

func (c *draContainerManager) PrepareDynamicResources(ctx context.Context, pod *v1.Pod) error {
	return c.dra.PrepareResources(ctx, pod)
}

func (c *draContainerManager) UnprepareDynamicResources(ctx context.Context, pod *v1.Pod) error {
	return c.dra.UnprepareResources(ctx, pod)
}

func (c *draContainerManager) PodMightNeedToUnprepareResources(uid types.UID) bool {
	return c.dra.PodMightNeedToUnprepareResources(uid)
}

func (c *draContainerManager) UpdateAllocatedResourcesStatus(logger klog.Logger, pod *v1.Pod,
	podStatus *v1.PodStatus) {
	if utilfeature.DefaultFeatureGate.Enabled(kubefeatures.ResourceHealthStatus) {
		c.dra.UpdateAllocatedResourcesStatus(logger, pod, podStatus)
	}
}

func (c *draContainerManager) Updates() <-chan resourceupdates.Update {
	return c.dra.Updates()
}

// cdiRecorder is the fake runtime as the kubelet sees it, writing what each CreateContainer asks
// the runtime to inject.
type cdiRecorder struct {
	internalapi.RuntimeService
	mu  sync.Mutex
	out *os.File
}

type createdContainer struct {
	Namespace  string   `json:"namespace"`
	Pod        string   `json:"pod"`
	PodUID     string   `json:"podUID"`
	Container  string   `json:"container"`
	CDIDevices []string `json:"cdiDevices"`
	Time       string   `json:"time"`
}

func (r *cdiRecorder) CreateContainer(ctx context.Context, podSandboxID string,
	cfg *runtimeapi.ContainerConfig, sandbox *runtimeapi.PodSandboxConfig) (string, error) {
	id, err := r.RuntimeService.CreateContainer(ctx, podSandboxID, cfg, sandbox)
	if err != nil {
		return id, err
	}
	entry := createdContainer{Container: cfg.GetMetadata().GetName(), CDIDevices: []string{},
		Time: time.Now().UTC().Format(time.RFC3339Nano)}
	if meta := sandbox.GetMetadata(); meta != nil {
		entry.Namespace, entry.Pod, entry.PodUID = meta.GetNamespace(), meta.GetName(), meta.GetUid()
	}
	for _, device := range cfg.GetCDIDevices() {
		entry.CDIDevices = append(entry.CDIDevices, device.GetName())
	}
	line, _ := json.Marshal(entry)
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, werr := r.out.Write(append(line, '\n')); werr != nil {
		return id, fmt.Errorf("record CDI devices: %w", werr)
	}
	return id, r.out.Sync()
}

type labels map[string]string

func (l labels) String() string { return fmt.Sprint(map[string]string(l)) }

func (l labels) Set(value string) error {
	for _, pair := range strings.Split(value, ",") {
		key, val, ok := strings.Cut(pair, "=")
		if !ok {
			return fmt.Errorf("label %q is not key=value", pair)
		}
		l[key] = val
	}
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "hollownode:", err)
		os.Exit(1)
	}
}

func run() error {
	nodeLabels := labels{}
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the node's identity (system:node:<name>)")
	nodeName := flag.String("name", "", "the node's name")
	rootDir := flag.String("root-dir", "/var/lib/kubelet", "the kubelet's root directory")
	endpoint := flag.String("runtime-endpoint", "", "unix:// socket of the fake container runtime")
	cdiLog := flag.String("cdi-log", "", "file the CreateContainer calls are written to (JSON lines)")
	port := flag.Int("port", 0, "the kubelet's server port")
	maxPods := flag.Int("max-pods", 110, "pods the node takes")
	flag.Var(nodeLabels, "node-labels", "key=value,... labels the node registers with")
	klog.InitFlags(nil)
	flag.Parse()
	if *kubeconfig == "" || *nodeName == "" || *endpoint == "" || *cdiLog == "" || *port == 0 {
		return fmt.Errorf("--kubeconfig, --name, --runtime-endpoint, --cdi-log and --port are required")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	clientConfig, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	clientConfig.UserAgent = "hollow-kubelet"
	client, err := clientset.NewForConfig(clientConfig)
	if err != nil {
		return err
	}
	flags, cfg := kubemark.GetHollowKubeletConfig(&kubemark.HollowKubeletOptions{
		NodeName: *nodeName, KubeletPort: *port, MaxPods: *maxPods, PodsPerCore: 0, NodeLabels: nodeLabels,
	})
	flags.RootDirectory = *rootDir
	cfg.Address = "127.0.0.1" // loopback only
	cfg.ReadOnlyPort = 0
	cfg.HealthzPort = 0
	cfg.StaticPodPath = ""
	cfg.NodeStatusUpdateFrequency.Duration = 2 * time.Second
	cfg.SyncFrequency.Duration = 2 * time.Second
	// Loopback only, for test tooling: /metrics (the DRA manager's dra_grpc_operations_duration
	// histogram, what the benchmarks read) answers without client credentials.
	cfg.Authentication.Anonymous.Enabled = true
	cfg.Authentication.Webhook.Enabled = false
	cfg.Authorization.Mode = kubeletconfig.KubeletAuthorizationModeAlwaysAllow

	heartbeatConfig := *clientConfig
	heartbeatConfig.Timeout = cfg.NodeStatusUpdateFrequency.Duration
	heartbeatConfig.QPS = -1
	heartbeatClient, err := clientset.NewForConfig(&heartbeatConfig)
	if err != nil {
		return err
	}

	draManager, err := dra.NewManager(klog.Background(), client, *rootDir)
	if err != nil {
		return fmt.Errorf("DRA manager: %w", err)
	}
	defer draManager.Stop()
	containerManager := &draContainerManager{ContainerManager: cm.NewStubContainerManager(), dra: draManager}

	fake := fakeremote.NewFakeRemoteRuntime()
	if err := fake.Start(*endpoint); err != nil {
		return fmt.Errorf("fake runtime: %w", err)
	}
	defer fake.Stop()
	runtimeService, err := remote.NewRemoteRuntimeServiceBuilder().
		WithEndpoint(*endpoint).WithConnectionTimeout(15 * time.Second).Build(ctx)
	if err != nil {
		return fmt.Errorf("runtime client: %w", err)
	}
	out, err := os.OpenFile(*cdiLog, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	recorder := &cdiRecorder{RuntimeService: runtimeService, out: out}

	hollow := kubemark.NewHollowKubelet(flags, cfg, client, heartbeatClient,
		&cadvisortest.Fake{NodeName: *nodeName}, fake.ImageService, recorder, containerManager)
	go hollow.Run(ctx)
	<-ctx.Done()
	klog.Info("hollownode: stopping")
	return nil
}
