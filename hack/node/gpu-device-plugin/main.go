// gpu-device-plugin advertises N devices of one extended resource (default
// nvidia.com/gpu) to the kubelet of moeguard's local real node, so that the
// operator's unchanged pod spec (resources.limits["nvidia.com/gpu"]) schedules
// there. There are no GPUs behind it: Allocate hands the container the
// NVIDIA_VISIBLE_DEVICES env that NVIDIA's own plugin sets (its "envvar"
// strategy) and nothing else. Built by hack/build-binaries.sh node, inside a
// main module that pins k8s.io/kubernetes, whose device-plugin stub it uses
// (the same stub as test/images/sample-device-plugin, which cannot be told a
// resource name).
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name to advertise")
	count := flag.Int("count", 8, "number of devices")
	dir := flag.String("socket-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin folder")
	flag.Parse()

	devs := make([]*pluginapi.Device, 0, *count)
	for i := 0; i < *count; i++ {
		devs = append(devs, &pluginapi.Device{ID: fmt.Sprintf("gpu-%d", i), Health: pluginapi.Healthy})
	}
	name := strings.NewReplacer("/", "-", ".", "-").Replace(*resource)
	stub := plugin.NewDevicePluginStub(devs, filepath.Join(*dir, "moeguard-"+name+".sock"), *resource, false, false)
	stub.SetAllocFunc(func(r *pluginapi.AllocateRequest, known map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error) {
		var resp pluginapi.AllocateResponse
		for _, req := range r.ContainerRequests {
			for _, id := range req.DevicesIds {
				if _, ok := known[id]; !ok {
					return nil, fmt.Errorf("unknown device %s", id)
				}
			}
			resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
				Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(req.DevicesIds, ",")},
			})
		}
		return &resp, nil
	})
	if err := stub.Start(); err != nil {
		klog.ErrorS(err, "start")
		os.Exit(1)
	}
	kubeletSock := filepath.Join(*dir, filepath.Base(pluginapi.KubeletSocket))
	if err := stub.Register(kubeletSock, *resource, *dir); err != nil {
		klog.ErrorS(err, "register with the kubelet")
		os.Exit(1)
	}
	klog.InfoS("advertising", "resource", *resource, "count", *count)
	go stub.Watch(kubeletSock, *resource, *dir) // re-registers when the kubelet restarts

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	_ = stub.Stop()
}
