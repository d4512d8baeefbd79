//! Which queue a device is opened with for its copies.

use ash::vk;

use super::CopyQueueChoice;

/// The queue a device is opened with for copies, chosen before it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueuePick {
    pub family: u32,
    pub index: u32,
    /// What it is, for reports.
    pub what: &'static str,
}

/// The queue for `choice` on the physical device ([`choose`] over its
/// queue families). `None` without timeline semaphores (Vulkan 1.2),
/// which the synchronization needs.
pub(crate) fn pick(
    instance: &ash::Instance,
    phd: vk::PhysicalDevice,
    choice: CopyQueueChoice,
) -> Option<QueuePick> {
    // SAFETY: queries of a physical device the adapter holds.
    unsafe {
        if instance.get_physical_device_properties(phd).api_version < vk::API_VERSION_1_2 {
            return None;
        }
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v12);
        instance.get_physical_device_features2(phd, &mut f2);
        if v12.timeline_semaphore == vk::FALSE {
            return None;
        }
        choose(&instance.get_physical_device_queue_family_properties(phd), choice)
    }
}

/// The queue for `choice` among `families` (wgpu's is family 0, queue
/// 0): under `Auto` a transfer-only family (the copy engines) before any
/// other family with transfers, video families last, a second queue of
/// family 0 only where no other family has transfers.
fn choose(families: &[vk::QueueFamilyProperties], choice: CopyQueueChoice) -> Option<QueuePick> {
    match choice {
        CopyQueueChoice::Off => None,
        CopyQueueChoice::Shared => Some(QueuePick {
            family: 0,
            index: 0,
            what: "wgpu's own queue (shared)",
        }),
        CopyQueueChoice::Auto => {
            let rank = |f: &vk::QueueFamilyProperties| {
                let video = vk::QueueFlags::VIDEO_DECODE_KHR | vk::QueueFlags::VIDEO_ENCODE_KHR;
                let busy = vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE;
                (
                    f.queue_flags.intersects(video),
                    (f.queue_flags & busy).as_raw().count_ones(),
                )
            };
            let other = families
                .iter()
                .enumerate()
                .skip(1)
                .filter(|(_, f)| f.queue_flags.contains(vk::QueueFlags::TRANSFER) && f.queue_count > 0)
                .min_by_key(|(_, f)| rank(f));
            match other {
                Some((i, f)) => Some(QueuePick {
                    family: i as u32,
                    index: 0,
                    what: if rank(f) == (false, 0) {
                        "a transfer-only queue family"
                    } else {
                        "a second queue family"
                    },
                }),
                None if families.first().is_some_and(|f| f.queue_count >= 2) => Some(QueuePick {
                    family: 0,
                    index: 1,
                    what: "a second queue of wgpu's family",
                }),
                None => None,
            }
        }
    }
}

/// Queue priorities that outlive the device's creation.
static ONE: [f32; 1] = [1.0];
static TWO: [f32; 2] = [1.0, 1.0];

/// Adds `pick`'s queue to the device wgpu-hal is about to create
/// (wgpu's own is family 0, index 0).
pub(crate) fn add_queue(pick: QueuePick, infos: &mut Vec<vk::DeviceQueueCreateInfo<'_>>) {
    match (pick.family, pick.index) {
        (0, 0) => {}
        (0, _) => {
            if let Some(info) = infos.iter_mut().find(|i| i.queue_family_index == 0) {
                *info = info.queue_priorities(&TWO);
            }
        }
        (f, _) => infos.push(
            vk::DeviceQueueCreateInfo::default()
                .queue_family_index(f)
                .queue_priorities(&ONE),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn families(list: &[(vk::QueueFlags, u32)]) -> Vec<vk::QueueFamilyProperties> {
        list.iter()
            .map(|&(queue_flags, queue_count)| vk::QueueFamilyProperties {
                queue_flags,
                queue_count,
                ..Default::default()
            })
            .collect()
    }

    const G: vk::QueueFlags = vk::QueueFlags::GRAPHICS;
    const C: vk::QueueFlags = vk::QueueFlags::COMPUTE;
    const T: vk::QueueFlags = vk::QueueFlags::TRANSFER;
    const V: vk::QueueFlags = vk::QueueFlags::VIDEO_DECODE_KHR;

    fn auto(list: &[(vk::QueueFlags, u32)]) -> Option<(u32, u32)> {
        choose(&families(list), CopyQueueChoice::Auto).map(|p| (p.family, p.index))
    }

    #[test]
    fn auto_takes_the_copy_engines_first() {
        // NVIDIA's usual layout: graphics, transfer-only (the copy
        // engines), async compute, then video families (here listing
        // transfers too, to check they are passed over).
        let nvidia = [(G | C | T, 16), (T, 2), (C | T, 8), (V | T, 1)];
        assert_eq!(auto(&nvidia), Some((1, 0)));
        let p = choose(&families(&nvidia), CopyQueueChoice::Auto).unwrap();
        assert_eq!(p.what, "a transfer-only queue family");
        // A video family listed before the copy engines is still passed over.
        assert_eq!(
            auto(&[(G | C | T, 1), (V | T, 1), (C | T, 4), (T, 2)]),
            Some((3, 0))
        );
        // No transfer-only family: the one with the least else.
        assert_eq!(auto(&[(G | C | T, 1), (G | C | T, 1), (C | T, 4)]), Some((2, 0)));
        // One family: its second queue, if it has one.
        assert_eq!(auto(&[(G | C | T, 4)]), Some((0, 1)));
        // lavapipe: one family of one queue; families without transfers
        // or without queues do not count.
        assert_eq!(auto(&[(G | C | T, 1)]), None);
        assert_eq!(auto(&[(G | C | T, 1), (C, 4), (T, 0)]), None);
    }

    #[test]
    fn off_and_shared_ignore_the_families() {
        let nvidia = families(&[(G | C | T, 16), (T, 2)]);
        assert_eq!(choose(&nvidia, CopyQueueChoice::Off), None);
        let shared = choose(&nvidia, CopyQueueChoice::Shared).unwrap();
        assert_eq!((shared.family, shared.index), (0, 0));
    }

    #[test]
    fn the_added_queue_is_the_one_picked() {
        let base = || {
            vec![
                vk::DeviceQueueCreateInfo::default()
                    .queue_family_index(0)
                    .queue_priorities(&ONE),
            ]
        };
        let pick = |family, index| QueuePick {
            family,
            index,
            what: "",
        };
        let mut infos = base();
        add_queue(pick(1, 0), &mut infos);
        assert_eq!(infos.len(), 2);
        assert_eq!((infos[1].queue_family_index, infos[1].queue_count), (1, 1));
        let mut infos = base();
        add_queue(pick(0, 1), &mut infos);
        assert_eq!((infos.len(), infos[0].queue_count), (1, 2));
        let mut infos = base();
        add_queue(pick(0, 0), &mut infos);
        assert_eq!((infos.len(), infos[0].queue_count), (1, 1));
    }
}
