//! Why wgpu found no adapter, in words a user can act on.
//!
//! On headless GPU machines and containers the usual causes are outside
//! megatrain: no Vulkan loader (`libvulkan.so.1`), an NVIDIA ICD whose
//! library (`libGLX_nvidia.so.0`) cannot load because libglvnd's dispatch
//! libraries are missing, a driver manifest in a directory the loader does
//! not search (`/usr/local/nvidia/share/vulkan/icd.d/` in NVIDIA's container
//! images), or a container started without the `graphics` driver
//! capability. Each check below tries what the loader itself would do
//! (load the library, read the manifest, load the manifest's library), so
//! the message names the file that failed and why.

use std::path::{Path, PathBuf};

/// Where the Vulkan loader looks for ICD manifests on Linux (its
/// documented default search path), plus the place NVIDIA's container
/// toolkit puts the driver's manifest, which the loader does not search.
const ICD_DIRS: &[&str] = &[
    "/usr/local/etc/vulkan/icd.d",
    "/usr/local/share/vulkan/icd.d",
    "/etc/vulkan/icd.d",
    "/usr/share/vulkan/icd.d",
];
const OFF_PATH_ICD_DIRS: &[&str] = &["/usr/local/nvidia/share/vulkan/icd.d", "/usr/local/nvidia/icd.d"];

/// What the diagnosis reads: the process environment and file system in
/// production, a fixture in tests.
#[derive(Debug, Clone)]
pub struct Probe {
    /// `VK_DRIVER_FILES` or the older `VK_ICD_FILENAMES`, if set.
    pub driver_files: Option<String>,
    /// `NVIDIA_DRIVER_CAPABILITIES`, if set.
    pub nvidia_caps: Option<String>,
    /// Directories the loader searches for manifests.
    pub icd_dirs: Vec<PathBuf>,
    /// Directories it does not search where drivers are known to put them.
    pub off_path_icd_dirs: Vec<PathBuf>,
    /// Whether an NVIDIA device node exists (`/dev/nvidia0`).
    pub nvidia_device: bool,
    /// The loader library to try.
    pub loader: String,
}

impl Probe {
    /// The real environment.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut icd_dirs: Vec<PathBuf> = ICD_DIRS.iter().map(PathBuf::from).collect();
        let data_dirs = var("XDG_DATA_DIRS").unwrap_or_else(|| "/usr/local/share:/usr/share".into());
        for d in data_dirs.split(':').filter(|d| !d.is_empty()) {
            let p = Path::new(d).join("vulkan/icd.d");
            if !icd_dirs.contains(&p) {
                icd_dirs.push(p);
            }
        }
        Probe {
            driver_files: var("VK_DRIVER_FILES").or_else(|| var("VK_ICD_FILENAMES")),
            nvidia_caps: var("NVIDIA_DRIVER_CAPABILITIES"),
            icd_dirs,
            off_path_icd_dirs: OFF_PATH_ICD_DIRS.iter().map(PathBuf::from).collect(),
            nvidia_device: Path::new("/dev/nvidia0").exists(),
            loader: "libvulkan.so.1".into(),
        }
    }
}

/// Tries to load a shared library the way the loader would; the error is
/// the dynamic linker's own message (it names the missing dependency).
fn try_load(lib: &str) -> Result<(), String> {
    // SAFETY: loading runs the library's initialisers. The libraries tried
    // here are the system's Vulkan loader and the ICDs it would itself load
    // into this process a moment later; nothing from them is called.
    match unsafe { libloading::Library::new(lib) } {
        Ok(l) => {
            drop(l);
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The `library_path` of an ICD manifest, resolved as the loader does
/// (relative paths against the manifest's directory, bare names through
/// the dynamic linker's search).
fn manifest_library(manifest: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(manifest).map_err(|e| format!("cannot read it: {e}"))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    let lib = json
        .pointer("/ICD/library_path")
        .and_then(|v| v.as_str())
        .ok_or("no ICD.library_path in it")?;
    Ok(if lib.contains('/') && !Path::new(lib).is_absolute() {
        manifest
            .parent()
            .unwrap_or(Path::new("."))
            .join(lib)
            .display()
            .to_string()
    } else {
        lib.to_string()
    })
}

fn manifests_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A manifest and whether its driver library loads.
fn check_manifest(m: &Path, out: &mut Vec<String>) {
    match manifest_library(m) {
        Err(e) => out.push(format!("  {}: {e}", m.display())),
        Ok(lib) => match try_load(&lib) {
            Ok(()) => out.push(format!("  {}: driver {lib} loads", m.display())),
            Err(e) => {
                // dlerror names the file it could not open first: the
                // driver itself, or one of its dependencies.
                let base = Path::new(&lib)
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned());
                let itself = base.is_some_and(|b| e.contains(&format!("{b}: cannot open")));
                let hint = if itself {
                    " (the driver library is not installed, or not mounted into this container)"
                } else if lib.contains("nvidia") {
                    " (NVIDIA's ICD needs libglvnd: install libglvnd0, libglx0, libegl1, libgl1)"
                } else {
                    ""
                };
                out.push(format!(
                    "  {}: driver {lib} does not load: {e}{hint}",
                    m.display()
                ));
            }
        },
    }
}

/// Lines explaining why no adapter was found, each naming what was checked.
pub fn diagnose(p: &Probe) -> String {
    let mut out = vec!["what was checked:".to_string()];
    match try_load(&p.loader) {
        Ok(()) => out.push(format!("- Vulkan loader {}: loads", p.loader)),
        Err(e) => out.push(format!(
            "- Vulkan loader {}: does not load ({e}); install it (Debian/Ubuntu: libvulkan1)",
            p.loader
        )),
    }
    match &p.driver_files {
        Some(files) => {
            out.push(format!("- VK_DRIVER_FILES/VK_ICD_FILENAMES = {files}:"));
            for f in files.split(':').filter(|f| !f.is_empty()) {
                let f = Path::new(f);
                if f.is_file() {
                    check_manifest(f, &mut out);
                } else {
                    out.push(format!("  {}: no such file", f.display()));
                }
            }
        }
        None => {
            let dirs: Vec<String> = p.icd_dirs.iter().map(|d| d.display().to_string()).collect();
            out.push(format!(
                "- driver manifests (VK_DRIVER_FILES unset) in {}:",
                dirs.join(", ")
            ));
            let found: Vec<PathBuf> = p.icd_dirs.iter().flat_map(|d| manifests_in(d)).collect();
            if found.is_empty() {
                out.push("  none".into());
            }
            for m in &found {
                check_manifest(m, &mut out);
            }
            for d in &p.off_path_icd_dirs {
                for m in manifests_in(d) {
                    out.push(format!(
                        "  {} exists but the loader does not search {}: export VK_DRIVER_FILES={}",
                        m.display(),
                        d.display(),
                        m.display()
                    ));
                }
            }
        }
    }
    if let Some(caps) = &p.nvidia_caps {
        let has = caps.split(',').any(|c| matches!(c.trim(), "graphics" | "all"));
        if !has {
            out.push(format!(
                "- NVIDIA_DRIVER_CAPABILITIES={caps} lacks 'graphics': the container runtime \
                 mounts no Vulkan driver; start the container with graphics (or all)"
            ));
        }
    }
    if p.nvidia_device {
        out.push("- /dev/nvidia0 exists: the kernel driver is there, so the user-space pieces above are what is missing".into());
    }
    out.push("see the README, \"Running on an NVIDIA GPU\"; --device auto falls back to the CPU".into());
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(dir: &Path) -> Probe {
        Probe {
            driver_files: None,
            nvidia_caps: None,
            icd_dirs: vec![dir.join("icd.d")],
            off_path_icd_dirs: vec![dir.join("nvidia/icd.d")],
            nvidia_device: false,
            loader: "libmegatrain-no-such-vulkan.so.1".into(),
        }
    }

    fn manifest(path: &Path, lib: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let json = format!(
            r#"{{"ICD": {{"library_path": "{lib}", "api_version": "1.3.0"}}, "file_format_version": "1.0.0"}}"#
        );
        std::fs::write(path, json).unwrap();
    }

    #[test]
    fn names_a_missing_loader_an_empty_search_path_and_an_off_path_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let off = dir.path().join("nvidia/icd.d/nvidia_icd.json");
        manifest(&off, "libGLX_nvidia.so.0");
        let p = Probe {
            nvidia_caps: Some("compute,utility".into()),
            nvidia_device: true,
            ..probe(dir.path())
        };
        let d = diagnose(&p);
        assert!(
            d.contains("libmegatrain-no-such-vulkan.so.1: does not load"),
            "{d}"
        );
        assert!(d.contains("libvulkan1"), "{d}");
        assert!(d.contains("none"), "{d}");
        assert!(
            d.contains(&format!("export VK_DRIVER_FILES={}", off.display())),
            "{d}"
        );
        assert!(d.contains("lacks 'graphics'"), "{d}");
        assert!(d.contains("/dev/nvidia0 exists"), "{d}");
    }

    #[test]
    fn names_a_driver_library_that_does_not_load() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("icd.d/nvidia_icd.json");
        manifest(&m, "libGLX_nvidia_megatrain_missing.so.0");
        let bad = dir.path().join("icd.d/broken.json");
        std::fs::write(&bad, "{ not json").unwrap();
        let d = diagnose(&probe(dir.path()));
        assert!(
            d.contains(&format!(
                "{}: driver libGLX_nvidia_megatrain_missing.so.0 does not load",
                m.display()
            )),
            "{d}"
        );
        assert!(d.contains("not installed, or not mounted"), "{d}");
        assert!(d.contains(&format!("{}: not JSON", bad.display())), "{d}");
    }

    #[test]
    fn checks_the_files_named_by_vk_driver_files() {
        let dir = tempfile::tempdir().unwrap();
        let rel = dir.path().join("icd.d/rel.json");
        manifest(&rel, "./libvulkan_missing.so");
        let p = Probe {
            driver_files: Some(format!(
                "{}:{}",
                rel.display(),
                dir.path().join("absent.json").display()
            )),
            nvidia_caps: Some("all".into()),
            ..probe(dir.path())
        };
        let d = diagnose(&p);
        let resolved = dir.path().join("icd.d/./libvulkan_missing.so");
        assert!(
            d.contains(&format!("driver {} does not load", resolved.display())),
            "{d}"
        );
        assert!(d.contains("absent.json: no such file"), "{d}");
        assert!(!d.contains("graphics"), "{d}");
        assert!(!d.contains("libglvnd"), "{d}");
    }
}
