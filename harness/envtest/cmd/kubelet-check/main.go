// Command kubelet-check runs the kubelet's own code (of the pinned release) on files this
// project writes for the kubelet, so tests prove the kubelet accepts them:
//
//	kubelet-check config-dir DIR
//	    Loads every *.conf drop-in of DIR as the kubelet's --config-dir does (strict
//	    decoding, apiVersion/kind check, merge) and prints the merged providerID.
//	kubelet-check credentials CONFIG BINDIR IMAGE
//	    Registers the exec credential providers of a CredentialProviderConfig as the
//	    kubelet's --image-credential-provider-config/--image-credential-provider-bin-dir do,
//	    looks IMAGE up through them (executing the plugin) and prints the credentials found
//	    as JSON: [{"username":..,"password":..}].
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	kubeletconfigv1beta1 "k8s.io/kubelet/config/v1beta1"
	"k8s.io/kubernetes/pkg/credentialprovider/plugin"
	kubeletscheme "k8s.io/kubernetes/pkg/kubelet/apis/config/scheme"
	"k8s.io/kubernetes/pkg/kubelet/kubeletconfig/configfiles"
	utilfs "k8s.io/kubernetes/pkg/util/filesystem"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-check: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	switch {
	case len(args) == 2 && args[0] == "config-dir":
		return configDir(args[1])
	case len(args) == 4 && args[0] == "credentials":
		return credentials(args[1], args[2], args[3])
	default:
		return fmt.Errorf("usage: kubelet-check config-dir DIR | credentials CONFIG BINDIR IMAGE")
	}
}

func configDir(dir string) error {
	_, strict, err := kubeletscheme.NewSchemeAndCodecs(serializer.EnableStrict)
	if err != nil {
		return err
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.conf"))
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no *.conf drop-in in %s", dir)
	}
	sort.Strings(files)
	merged := []byte("{}")
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			return err
		}
		// Unknown or misspelt fields are errors here (the kubelet would only warn).
		if _, _, err := strict.UniversalDecoder().Decode(data, nil, nil); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		loader, err := configfiles.NewFsLoader(&utilfs.DefaultFs{}, name)
		if err != nil {
			return err
		}
		dropin, gvk, err := loader.LoadIntoJSON()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if gvk == nil || *gvk != kubeletconfigv1beta1.SchemeGroupVersion.WithKind("KubeletConfiguration") {
			return fmt.Errorf("%s: unknown apiVersion/kind %v", name, gvk)
		}
		if merged, err = jsonpatch.MergePatch(merged, dropin); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	var config kubeletconfigv1beta1.KubeletConfiguration
	if err := json.Unmarshal(merged, &config); err != nil {
		return err
	}
	fmt.Println(config.ProviderID)
	return nil
}

type credential struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

func credentials(config, binDir, image string) error {
	if err := plugin.RegisterCredentialProviderPlugins(config, binDir, nil, nil); err != nil {
		return err
	}
	found, _ := plugin.NewExternalCredentialProviderDockerKeyring("", "", "", "").Lookup(image)
	out := []credential{}
	for _, c := range found {
		out = append(out, credential{Username: c.Username, Password: c.Password})
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}
